"""Which low-precision kernel makes a one-row draft step cheapest, and what it costs in agreement.

    python scripts/draft_kernels.py [--model qwen2.5-coder-1.5b] [--layers 28] [--reps 5] [--no-agreement]

Two measurements, appended as one JSON line to --out:

- speed: the MLP products of Qwen2.5-Coder-1.5B (8960x1536 and 1536x8960, random weights,
  ``--layers`` of each so that they do not fit in cache) at one input row (a draft step), through
  the kernels a draft could use: the prepacked bf16 copy decoding verifies with, int8 weight-only
  (``_weight_int8pack_mm``), int4 weight-only in groups of 32 and 128
  (``_weight_int4pack_mm_for_cpu``; the draft's ``weights: int8 | int4``), int4 in groups of 32 and 128
  through our VNNI kernel (int8 activations: :mod:`selfspec.kernels.vnni`, where it runs), and fbgemm's dynamic
  int8 (int8 weights per output row, activations quantized per call to 8 bits with one scale
  for the whole row: ``torch.ao.nn.quantized.dynamic.Linear``). Weights read per second, best of
  ``--reps``, kernels in rotating order.
- agreement: on one calibration prompt of each task set, the full model's greedy continuation
  (``--tokens``), then one teacher-forced forward with every decoder linear through each kernel;
  the share of positions whose argmax equals the full model's (the LM head stays bf16).
- the VNNI kernel's rounding of the activations to int8: on the inputs every decoder linear takes at the
  continuations' positions of the full model's forwards over those sequences, its product against the same int4
  weights (g128) times the unrounded activations in float64; the relative error ||y - y64|| / ||y64|| of each
  linear, median and largest over the linears, through the kernel and with the rounding emulated in blocks of 64
  and of 128 inputs (the kernel's), beside what rounding the exact product to bf16 alone gives.

The dynamic kernel is not a draft option: this script is why (see docs/log.md).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn

from selfspec.assets.models import load_model
from selfspec.cli.config import calibration_prompts
from selfspec.draft.lowbit import LowPrecisionLinear, quantize, quantized_mm
from selfspec.engine.decoding import DecodeConfig, autoregressive
from selfspec.engine.harness import rotated
from selfspec.kernels import vnni
from selfspec.kernels.packed import LinearWrapper, PackedLinear
from selfspec.model.wrap import wrap_descendants
from selfspec.provenance import append_row, git_commit, machine_fingerprint

# name -> (format, group size, kernel); int8 has one scale per row, so its group size goes unused
LOW = {"int8": ("int8", 32, "int8"), "int4-g32": ("int4", 32, "int4"), "int4-g128": ("int4", 128, "int4"),
       "int4-g32 vnni": ("int4", 32, "int4-vnni"), "int4-g128 vnni": ("int4", 128, "int4-vnni")}
if not vnni.available():
    LOW = {name: v for name, v in LOW.items() if v[2] != "int4-vnni"}


class DynamicInt8Linear(LinearWrapper):
    """A linear of one model instance through fbgemm's dynamic int8 kernel while ``active``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__(inner)
        import torch.ao.nn.quantized.dynamic as nnqd

        ref = nn.Linear(inner.in_features, inner.out_features, bias=inner.bias is not None)
        ref.weight.data = inner.weight.detach().float()
        if inner.bias is not None:
            ref.bias.data = inner.bias.detach().float()
        ref.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13; the kernel still runs
            warnings.simplefilter("ignore")
            self.q = nnqd.Linear.from_float(ref)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return self.inner(x)
        return self.q(x.float()).to(x.dtype)


def speeds(layers: int, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for _ in range(layers) for n, k in ((8960, 1536), (1536, 8960))]
    calls: dict[str, list] = {"bf16 packed": [], "int8 dynamic (fbgemm)": []}
    calls.update({name: [] for name in LOW})
    for w in weights:
        x = torch.randn(1, w.shape[1], dtype=torch.bfloat16)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        lin.weight.data = w
        packed = PackedLinear(lin)
        packed.active = True
        calls["bf16 packed"].append((packed, x))
        dyn = DynamicInt8Linear(lin)
        dyn.active = True
        calls["int8 dynamic (fbgemm)"].append((dyn, x))
        for name, (kind, group, kernel) in LOW.items():
            _, q, s = quantize(w, kind, group, kernel)
            calls[name].append((lambda x, k=kernel, group=group, q=q, s=s: quantized_mm(x, k, group, q, s), x))
    n_weights = sum(w.numel() for w in weights)
    best = {name: float("inf") for name in calls}
    names = list(calls)
    with torch.inference_mode():
        for rep in range(reps + 1):
            for name in rotated(names, rep):
                t0 = time.perf_counter()
                for f, x in calls[name]:
                    f(x)
                if rep:  # repetition 0 is the warm-up
                    best[name] = min(best[name], time.perf_counter() - t0)
    return {name: round(n_weights / t / 1e9, 1) for name, t in best.items()}


def _outer_linears(layers: nn.Module) -> list[nn.Module]:
    """The decoder's linears as the forward calls them: each nn.Linear, or the outermost wrapper around one."""
    inner = {id(m.inner) for m in layers.modules() if isinstance(m, LinearWrapper)}
    return [m for m in layers.modules() if isinstance(m, (nn.Linear, LinearWrapper)) and id(m) not in inner]


def rounding_error(model: nn.Module, seqs: list, tokens: int, group: int = 128) -> dict:
    """What the VNNI kernel's int8 rounding of the activations costs: on the inputs the decoder linears take at the
    last ``tokens`` positions of the full model's forwards over ``seqs``, each linear's relative error against the
    float64 product with the same int4 weights (median and largest over the linears), through the kernel and with
    the rounding emulated per block of 64 and of 128 inputs (the kernel's), beside what rounding
    the exact product to bf16 alone gives."""
    linears = _outer_linears(model.model.layers)
    inputs: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in linears}
    hooks = [m.register_forward_pre_hook(lambda m, a: inputs[m].append(a[0].reshape(-1, a[0].shape[-1])[-tokens:]))
             for m in linears]
    errs: dict[str, list[float]] = {"kernel": [], "blocks of 64": [], "blocks of 128": [], "bf16 output": []}
    with torch.inference_mode():
        for _, ids in seqs:
            model(ids)
        for h in hooks:
            h.remove()
        for m in linears:
            x = torch.cat(inputs.pop(m))
            _, q, sz = quantize(m.weight.detach(), "int4", group, "int4-vnni")
            w64 = vnni.dequantize(q, sz, group)
            y64 = x.double() @ w64.T
            norm = y64.norm()
            outs = {"kernel": vnni.mm(x, q, sz, group).double(), "bf16 output": y64.to(torch.bfloat16).double(),
                    **{f"blocks of {b}": vnni.round_activations(x, b) @ w64.T for b in (64, 128)}}
            for name, y in outs.items():
                errs[name].append(float((y - y64).norm() / norm))
    summary = {name: {"median": round(float(torch.tensor(e).median()), 5), "max": round(max(e), 5)}
               for name, e in errs.items()}
    return {**summary, "linears": len(linears), "rows": x.shape[0], "group": group}


def agreement(model_name: str, tokens: int) -> tuple[dict[str, float], dict | None]:
    lm = load_model(model_name)
    model = lm.model
    prompts = calibration_prompts(lm.tokenizer, ["humaneval", "gsm8k", "mtbench", "summarization"], 1)
    seqs = []
    with torch.inference_mode():
        for p in prompts:
            cont = autoregressive(model, p, DecodeConfig(max_new_tokens=tokens), lm.eos_ids).tokens
            seqs.append((len(p), torch.tensor([p + cont])))
        ref = [model(ids).logits[0, n - 1 : -1].argmax(-1) for n, ids in seqs]
    errors = rounding_error(model, seqs, tokens) if vnni.available() else None
    if errors:
        print(f"int8 activations, relative error against float64 products over {errors['linears']} linears "
              f"(median / largest): " + ", ".join(f"{name} {e['median']:.2%} / {e['max']:.2%}" for name, e in errors.items()
                                                  if isinstance(e, dict)), flush=True)
    layers = model.model.layers
    low = wrap_descendants(layers, LowPrecisionLinear, match=lambda m: isinstance(m, nn.Linear),
                           make=lambda m: LowPrecisionLinear(m, "int8", 32), on_existing=lambda m: None)
    out = {}
    variants = [(name, *v) for name, v in LOW.items()] + [("int8 dynamic (fbgemm)", None, 0, None)]
    for name, kind, group, kernel in variants:
        if kind is None:
            for m in low:
                m.active = False
            dyn = wrap_descendants(layers, DynamicInt8Linear, match=lambda m: isinstance(m, LowPrecisionLinear),
                                   make=DynamicInt8Linear, on_existing=lambda m: None)
            active = dyn
        else:
            for m in low:  # this kernel's copy in place of the one configure() would pick for the format
                m.group = group
                m.kernel, m.qweight, m.qscale = quantize(m.inner.weight.detach(), kind, group, kernel)
            active = low
        for m in active:
            m.active = True
        with torch.inference_mode():
            hits = total = 0
            for (n, ids), r in zip(seqs, ref):
                top = model(ids).logits[0, n - 1 : -1].argmax(-1)
                hits += int((top == r).sum())
                total += r.numel()
        for m in active:
            m.active = False
        out[name] = round(hits / total, 3)
        print(f"{name:24s} argmax agrees with the full model on {out[name]:.3f} of {total} positions", flush=True)
    return out, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="results/draft_kernels.jsonl")
    ap.add_argument("--no-agreement", action="store_true",
                    help="time the kernels only (the agreement loads the model and takes most of the run)")
    args = ap.parse_args()
    rates = speeds(args.layers, args.reps)
    for name, r in rates.items():
        print(f"{name:24s} {r:6.1f} G weights/s at one row", flush=True)
    agree, errors = (None, None) if args.no_agreement else agreement(args.model, args.tokens)
    row = {"model": args.model, "layers": args.layers, "reps": args.reps,
           **({} if agree is None else {"tokens": args.tokens}),
           "g_weights_per_s": rates, "argmax_agreement": agree, "activation_rounding_error": errors,
           "int4_act_block": vnni.ACT_BLOCK if vnni.available() else None, "torch": torch.__version__,
           "machine": machine_fingerprint(), "commit": git_commit()}
    append_row(args.out, row, echo=False)


if __name__ == "__main__":
    main()
