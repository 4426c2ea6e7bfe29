"""Does the draft's quantization line up with the packaged checkpoint's 4-bit grid? Acceptance and error per format.

    python scripts/quant_alignment.py results/plans/qwen2.5-coder-1.5b-default.json \
        results/optuna/qwen2.5-coder-1.5b-tasks-avx2-v8.db

The packaged checkpoints are 4-bit GGUF files (Q4_K_M: blocks of 32) dequantized to bf16, so an
int4 draft whose groups are 32 wide rebuilds weights that already lie on a 4-bit grid; groups of
128 do not line up, and tell what a true bf16 checkpoint would give. For the searched draft with
its kept weights as bf16 (model), int8, int4 g32 and int4 g128: the simulated acceptance and
tokens per round on the search's calibration prompts and continuations (stored beside its study),
and the relative output error of the quantized kernels on random inputs for the linears of a few
layers. Appends one JSON line to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from selfspec.assets.models import load_model
from selfspec.draft.lowbit import LowPrecisionLinear
from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.model.arch import arch_of
from selfspec.provenance import append_row, git_commit, machine_fingerprint
from selfspec.search.calibration import study_calibration
from selfspec.search.simulate import RoundSimulator

FORMATS = {"model": DraftOptions(), "int8": DraftOptions(weights="int8"),
           "int4-g32": DraftOptions(weights="int4", group_size=32), "int4-g128": DraftOptions(weights="int4", group_size=128)}


def output_error(model, options: DraftOptions, layers: list[int]) -> float:
    """||x W_q - x W|| / ||x W|| over the linears of ``layers`` (random bf16 inputs, the real kernels)."""
    torch.manual_seed(0)
    num = den = 0.0
    blocks = arch_of(model).layers
    with torch.inference_mode():
        for i in [i for i in layers if i < len(blocks)]:
            for lin in [m for m in blocks[i].modules() if isinstance(m, torch.nn.Linear)]:
                q = LowPrecisionLinear(lin, options.weights, options.group_size)
                x = torch.randn(16, lin.in_features, dtype=lin.weight.dtype)
                ref = lin(x).float()
                q.active = True
                num += float((q(x).float() - ref).pow(2).sum())
                den += float(ref.pow(2).sum())
    return (num / den) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("draft")
    ap.add_argument("storage", help="the study's storage (its calibration prompts and continuations)")
    ap.add_argument("--study", help="the study's name (default: the draft file's name)")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 9, 18, 27])
    ap.add_argument("--out", default="results/quant_alignment.jsonl")
    args = ap.parse_args()
    spec = DraftSpec.load(args.draft)
    saved = study_calibration(args.storage, args.study or Path(args.draft).stem)
    lm = load_model(saved["key"]["model"])
    sim = RoundSimulator(lm.model, saved["key"]["prompts"], saved["continuations"], lm.eos_ids)
    row = {"draft": args.draft, "draft_options": spec.describe(), "prompts": len(sim.prompts),
           "git_commit": git_commit(), "machine": machine_fingerprint(), "formats": {}}
    for name, fmt in FORMATS.items():
        o = spec.options
        variant = spec.replace(options=DraftOptions(weights=fmt.weights, group_size=fmt.group_size,
                                                    head_tokens=o.head_tokens, ngram=o.ngram, copy_tokens=o.copy_tokens))
        counts = sim.simulate(variant)
        no_copy = sim.simulate(variant.replace(options=DraftOptions(weights=fmt.weights, group_size=fmt.group_size,
                                                                    head_tokens=o.head_tokens)))
        err = output_error(lm.model, fmt, args.layers) if fmt.weights != "model" else 0.0
        row["formats"][name] = {"acceptance": round(counts.acceptance, 4), "tokens_per_round": round(counts.tokens_per_round, 3),
                                "acceptance_without_copy": round(no_copy.acceptance, 4),
                                "tokens_per_round_without_copy": round(no_copy.tokens_per_round, 3),
                                "relative_output_error": round(err, 4)}
        print(name, row["formats"][name], flush=True)
    append_row(args.out, row, echo=False)


if __name__ == "__main__":
    main()
