"""The cost model: seconds of the forwards a draft round is made of, measured on this machine.

Cost belongs to the machine, acceptance to the model and the prompts: the
search keeps them apart (:mod:`selfspec.search.pipeline` re-measures this model
when the machine fingerprint changes and re-scores the trials from their stored
round counts). Measured, all on the weights decoding uses (packed bf16):

- ``t_full``: one full-depth one-token forward (a plain decoding step);
- ``t_verify[m]``: a full-depth forward over ``m`` tokens (verifying ``m-1`` drafts);
- per draft weight format (``model``, ``int8``, ``int4-g32``, ...): a one-token
  draft forward after another one as ``base + kept attention x attn + kept MLP x mlp``, and how much more
  the first draft forward of a round costs (``first``: it comes after a full-depth forward, which has
  evicted the draft's weights from the caches);
- per draft head size ``N``: what scoring N token ids instead of all saves (``head``);
- per draft head size and quantized head format (``"<N>/<format>"``, N = 0 for the whole vocabulary):
  what that head saves over the model-precision full head (``head_low``); heads are timed alone;
- what the decoding loop adds to each kind of step (``overhead``, :func:`loop_overheads`); a verify's depends on
  what ran before it: draft steps of one weight format (``verify/<format>``: they may have evicted the model's
  weights) or a verify (a copy round: ``verify/model``, the all-kept model-precision draft being a full forward).

A draft round with ``m`` tokens drafted costs ``(m - 1 + first) x t_step + t_verify[m+1]``, a
copy round ``t_verify[m+1]``, a draft-tree round of ``nodes`` nodes the same with ``t_verify[nodes+1]``
(no draft step for copy trees; loop overheads added per step), a plain step ``t_full``; the predicted speedup of
a draft is ``tokens x t_full / time`` over the simulated rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace

import torch

from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.engine.attention import decode_attention
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import DecodeConfig, autoregressive, forward_at
from selfspec.engine.harness import rotated
from selfspec.engine.speculate import self_speculative
from selfspec.engine.stats import Clock
from selfspec.kernels.packed import packed_weights
from selfspec.model.arch import num_layers
from selfspec.model.plan import SkipPlan
from selfspec.provenance import machine_fingerprint
from selfspec.search.rounds import RoundCounts

# The way costs are measured; a saved cost model of another version is measured again. 2: each draft path
# puts its own weight format and head in place while it drafts (version 1 timed every low-precision format
# as the last path built on the model, and every head as the last one prepared). 3: the loop's overhead per
# draft step pooled over the weight formats, the adaptive exit's own work and the draft heads timed alone
# (version 2 took them from differences of whole runs or forwards: -26 to +27 ms for a softmax that costs
# under 1 ms, 3 to 13 ms saved by one int4 head). 4: the loop overheads scale each repetition by the mean of
# the AR runs just before and just after it (version 3: by one AR run before it), after a short warm-up.
# 5: what is measured changed, not how: the decode attention multiplies the values in float32 (a bf16 product
# there cost a 6-row verify over 1000 keys ~2x on AVX2, selfspec/engine/attention.py), so verifies and plain
# steps priced by version 4 are too dear. 6: each draft forward is timed right after itself (a later step of a
# round), and the all-kept draft once more right after a plain forward (a round's first step, ``first``); version 5
# timed the all-kept draft after a verify and the skipping ones after other drafts, so on a Xeon with a large L3
# the sublayer costs were differences of a cold and a warm forward (a draft step priced 1.56x what it took).
# 7: the loop's overhead per verify is measured per weight format of the draft steps before it (``verify/<format>``);
# version 6 pooled it over the formats, so a verify after int4 draft steps was priced as if half of them had been
# model-precision ones (6% under what it took on a 2-core Xeon).
COST_MODEL_VERSION = 7


def weight_format(options: DraftOptions) -> str:
    """The cost model's key of a draft's weight format."""
    return f"int4-g{options.group_size}" if options.weights == "int4" else options.weights


def formats_of(costs: CostModel) -> list[DraftOptions]:
    """The draft weight formats ``costs`` holds, one :class:`DraftOptions` a key (:func:`weight_format`'s inverse)."""
    return [DraftOptions(weights="int4", group_size=int(key.removeprefix("int4-g"))) if key.startswith("int4-g")
            else DraftOptions(weights=key) for key in costs.draft]


def head_format(options: DraftOptions) -> str:
    """The cost model's key of a quantized draft head (``head_low``)."""
    key = f"{options.head_tokens}/" + weight_format(replace(options, weights=options.head_weights))
    return key + f"+r{options.head_rescore}" if options.head_rescore else key


@dataclass
class SublayerCosts:
    base: float  # embedding, norms, head and overhead of a one-token forward
    attn: float  # each kept attention sublayer
    mlp: float  # each kept MLP sublayer
    first: float = 1.0  # a round's first draft step over a later one (cost models before version 6: 1)


@dataclass
class CostModel:
    t_full: float
    t_verify: dict[int, float]  # tokens in the forward -> seconds
    num_layers: int
    draft: dict[str, SublayerCosts] = field(default_factory=dict)  # weight format -> costs
    head: dict[int, float] = field(default_factory=dict)  # draft head tokens -> seconds saved (<= 0 added)
    head_low: dict[str, float] = field(default_factory=dict)  # head_format() -> seconds saved over the full head
    machine: dict = field(default_factory=dict)
    # what a step costs inside the decoding loop beyond the raw forward timed above (bookkeeping, argmax,
    # the kernels' behaviour in the loop), from short real runs: per plain step, per draft step (pooled over
    # the weight formats: "draft_step"; cost models of version 2 and older kept one per format,
    # "draft_step/<format>"), per verify pass; negative where the loop ran faster than the isolated forward.
    # "adaptive_step": the adaptive exit's confidence (a softmax over the vocabulary) per draft step, timed alone
    overhead: dict[str, float] = field(default_factory=dict)
    version: int = 1  # COST_MODEL_VERSION of the code that measured it (saved ones from before versions: 1)

    def _o(self, name: str) -> float:
        return self.overhead.get(name, 0.0)

    def step_time(self, spec: DraftSpec) -> float:
        """One draft step of ``spec``."""
        fmt = weight_format(spec.options)
        if fmt not in self.draft:
            raise KeyError(f"the cost model has no draft weights {fmt}; measured: {sorted(self.draft)}")
        c, n, plan = self.draft[fmt], self.num_layers, spec.plan
        t = c.base + (n - len(plan.attn)) * c.attn + (n - len(plan.mlp)) * c.mlp
        if spec.options.head_weights != "model":
            key = head_format(spec.options)
            if key not in self.head_low:
                raise KeyError(f"the cost model has no draft head {key}; measured: {sorted(self.head_low)}")
            t -= self.head_low[key]
        elif spec.options.head_tokens:
            t -= self.head[spec.options.head_tokens]
        return max(t, 1e-9)

    def verify_time(self, m: int) -> float:
        if m not in self.t_verify:
            raise KeyError(f"the cost model has no verify forward over {m} tokens (measured up to {max(self.t_verify)})")
        return self.t_verify[m]

    def time(self, counts: RoundCounts, spec: DraftSpec) -> float:
        """Seconds the simulated rounds take (prefill excluded)."""
        return sum(self.breakdown(counts, spec).values())

    def breakdown(self, counts: RoundCounts, spec: DraftSpec) -> dict[str, float]:
        """:meth:`time` by what the loop clocks apart: draft steps, verify passes, plain steps."""
        fmt = weight_format(spec.options)
        verify = sum(n * self._verify(m + 1, fmt if m else None) for m, n in counts.model_rounds.items())
        verify += sum(n * self._verify(m + 1) for m, n in counts.copy_rounds.items())
        verify += sum(n * self._verify(nodes + 1, fmt if m else None) for (m, nodes), n in counts.tree_rounds.items())
        plain = counts.plain_steps * (self.t_full + self._o("plain_step"))
        draft = self.draft_time(spec, counts.model_drafted, counts.model_draft_rounds)
        return {"draft": draft, "verify": verify, "plain": plain}

    def draft_forwards(self, spec: DraftSpec, drafted: int, rounds: int) -> float:
        """Seconds of the forwards of ``drafted`` draft steps made in ``rounds`` rounds (each round's first step
        costs ``first`` later ones), without what the loop adds."""
        return self.step_time(spec) * (drafted + (self.draft[weight_format(spec.options)].first - 1.0) * rounds)

    def draft_time(self, spec: DraftSpec, drafted: int, rounds: int) -> float:
        """:meth:`draft_forwards` and what the loop adds to each draft step."""
        over = self.overhead.get("draft_step", self._o(f"draft_step/{weight_format(spec.options)}"))
        over += self._o("adaptive_step") if spec.adaptive else 0.0
        return max(self.draft_forwards(spec, drafted, rounds) + drafted * over, 1e-9 * drafted)

    def _verify(self, m: int, after: str | None = None) -> float:
        """A verify over ``m`` tokens in the loop, after draft steps of weight format ``after`` (None: after no
        draft step)."""
        over = verify_overhead(self.overhead, after)
        return max(self.verify_time(m) + (0.0 if over is None else over), 1e-9)

    def predicted_speedup(self, counts: RoundCounts, spec: DraftSpec) -> float:
        """Over our autoregressive loop: one plain step per token."""
        t = self.time(counts, spec)
        return counts.tokens * (self.t_full + self._o("plain_step")) / t if t > 0 else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["t_verify"] = {str(k): v for k, v in self.t_verify.items()}
        d["head"] = {str(k): v for k, v in self.head.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(d["t_full"], {int(k): v for k, v in d["t_verify"].items()}, d["num_layers"],
                   {k: SublayerCosts(**v) for k, v in d.get("draft", {}).items()},
                   {int(k): v for k, v in d.get("head", {}).items()}, dict(d.get("head_low", {})), d.get("machine", {}),
                   d.get("overhead", {}), d.get("version", 1))


def verify_overhead(overhead: dict[str, float], after: str | None = None) -> float | None:
    """What the loop adds to a verify after draft steps of weight format ``after`` (None: after no draft step), from
    a cost model's ``overhead``: ``verify/<format>``, or in cost models before version 7 the one ``verify`` of every
    verify; None where it has neither."""
    return overhead.get(f"verify/{after or 'model'}", overhead.get("verify"))


def measure_costs(model, context: list[int], formats: list[DraftOptions], head_tokens: list[int],
                  max_verify: int, reps: int = 7, stop_ids=(), machine: dict | None = None,
                  head_formats: list[DraftOptions] = ()) -> CostModel:
    """Time every forward the cost model needs, round-robin (so load changes hit all alike), medians.

    ``formats``: one :class:`DraftOptions` per draft weight format to cost; ``head_tokens``:
    the draft head sizes to cost; ``head_formats``: quantized head formats (``head_weights``,
    ``group_size``) to cost at each of those sizes and the full head; ``max_verify``: the longest
    verify forward (tokens).
    """
    n = num_layers(model)
    device = next(model.parameters()).device
    clock = Clock(device)
    ctx = list(context)
    cache = PositionalKVCache(model, max_len=len(ctx) + max_verify + 1)
    tokens = torch.tensor(ctx, dtype=torch.long, device=device)
    probe = torch.tensor((ctx * (max_verify // max(len(ctx), 1) + 1))[:max_verify], dtype=torch.long, device=device)
    full, all_attn, all_mlp = SkipPlan(n), SkipPlan(n, attn=tuple(range(n))), SkipPlan(n, mlp=tuple(range(n)))
    # what each timed forward follows: nothing set up ("after": None), itself, untimed ("self": a later draft step,
    # the weights it reads last read by the step before), or a plain forward ("full": a round's first draft step)
    configs: dict[str, tuple[int, Callable[[], ExitStack], str | None]] = {"full": (1, ExitStack, None)}
    for m in range(2, max_verify + 1):
        configs[f"verify{m}"] = (m, ExitStack, None)
    for opts in formats:
        fmt = weight_format(opts)
        for tag, plan in (("all", full), ("no_attn", all_attn), ("no_mlp", all_mlp)):
            path = DraftPath(model, plan, DraftOptions(weights=opts.weights, group_size=opts.group_size),
                             stop_ids=stop_ids)
            if tag == "all":  # the first step, then a later one right after it
                configs[f"{fmt}/first"] = (1, path.drafting, "full")
            configs[f"{fmt}/{tag}"] = (1, path.drafting, None if tag == "all" else "self")
    # the draft heads differ from the full head in the head alone: timed alone (a head costs 2-20 ms, a
    # difference of two whole forwards of ~100 ms each lost it in their noise)
    heads: dict[str, DraftPath] = {}
    for size in head_tokens:
        if size:
            heads[f"head{size}"] = DraftPath(model, full, DraftOptions(head_tokens=size), stop_ids=stop_ids)
    heads["head0"] = DraftPath(model, full, DraftOptions(), stop_ids=stop_ids)
    lows = [DraftOptions(head_tokens=size, head_weights=o.head_weights, group_size=o.group_size,
                         head_rescore=o.head_rescore) for o in head_formats for size in sorted({0, *head_tokens})]
    for opts in lows:
        heads[f"head{head_format(opts)}"] = DraftPath(model, full, opts, stop_ids=stop_ids)
    for path in heads.values():
        path.prepare(tokens)
    times: dict[str, list[float]] = {name: [] for name in configs}
    lm_head = model.get_output_embeddings()
    hidden = torch.randn(1, 1, lm_head.weight.shape[1], dtype=lm_head.weight.dtype, device=device)
    with torch.inference_mode(), packed_weights(model), decode_attention(model):
        forward_at(model, cache, tokens, 0, keep=1)
        for rep in range(reps + 1):
            for name, (m, ctx_manager, after) in configs.items():
                if after == "full":
                    forward_at(model, cache, probe[:1], len(ctx), keep=1)
                with ctx_manager():
                    if after == "self":
                        forward_at(model, cache, probe[:m], len(ctx), keep=1)
                    t0 = clock.now()
                    forward_at(model, cache, probe[:m], len(ctx), keep=1)
                    dt = clock.now() - t0
                if rep:  # repetition 0 is the warm-up
                    times[name].append(dt)
        head_times = time_heads(heads, hidden, 3 * reps, clock)
    # each forward in units of the plain forward timed in the same pass, times the median plain forward: the
    # machine's speed drifts (by a quarter within minutes on a shared 2-core VM, docs/log.md), and a drift
    # between passes then moves every cost alike instead of skewing the differences the sublayer costs come from
    full_med = statistics.median(times["full"])
    med = {name: full_med * statistics.median(t / f for t, f in zip(v, times["full"])) for name, v in times.items()}
    draft = {}
    for opts in formats:
        fmt = weight_format(opts)
        t_all, t_no_attn, t_no_mlp = (med[f"{fmt}/{tag}"] for tag in ("all", "no_attn", "no_mlp"))
        attn, mlp = max(t_all - t_no_attn, 0.0) / n, max(t_all - t_no_mlp, 0.0) / n
        draft[fmt] = SublayerCosts(base=max(t_all - n * (attn + mlp), 0.0), attn=attn, mlp=mlp,
                                   first=med[f"{fmt}/first"] / t_all)
    head_med = {name: statistics.median(v) for name, v in head_times.items()}
    head = {size: head_med["head0"] - head_med[f"head{size}"] for size in head_tokens if size}
    head_low = {head_format(o): head_med["head0"] - head_med[f"head{head_format(o)}"] for o in lows}
    verify = {m: med[f"verify{m}"] for m in range(2, max_verify + 1)}
    costs = CostModel(t_full=med["full"], t_verify=verify, num_layers=n, draft=draft, head=head, head_low=head_low,
                      machine=machine or {}, version=COST_MODEL_VERSION)
    costs.overhead = loop_overheads(model, ctx[: max(len(ctx) // 2, 1)], costs, formats, stop_ids,
                                    reps=max(reps // 2, 2))
    return costs


def time_heads(paths: dict[str, DraftPath], hidden: torch.Tensor, reps: int, clock: Clock) -> dict[str, list[float]]:
    """Seconds of the model's LM head alone on ``hidden`` while each path drafts (each with its own head),
    round-robin, ``reps`` repetitions after a warm-up one. The paths must be prepared."""
    head = next(iter(paths.values())).model.get_output_embeddings()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(reps + 1):
        for name, path in paths.items():
            with path.drafting():
                t0 = clock.now()
                head(hidden)
                dt = clock.now() - t0
            if rep:  # repetition 0 is the warm-up
                times[name].append(dt)
    return times


def loop_overheads(model, prompt: list[int], costs: CostModel, formats: list[DraftOptions], stop_ids=(),
                   reps: int = 3, tokens: int = 24) -> dict[str, float]:
    """What a step costs in the decoding loop beyond the modelled forward, from short real runs
    (medians over ``reps`` repetitions after a short warm-up).

    A plain autoregressive step against ``t_full``; per weight format, a draft step of a draft
    with every sublayer kept (k=3, greedy, no fallback) against its modelled steps, and its verify
    passes against the modelled ones. The loop's work around a draft step does not depend on the
    weights, and one short run's draft time is noisy (a tenth of a step), so the draft-step overhead
    is the median over every (format, repetition): one ``draft_step``. A verify's does depend on them
    (what the draft steps before it read decides how much of the model's weights the caches still
    hold), so it is one per format, ``verify/<format>``; ``verify`` pools them, for reports. The adaptive exit's own work
    per draft step (a softmax over the vocabulary for the confidence) is timed alone
    (:func:`confidence_cost`): as the difference of two real runs it was lost in their noise.

    The runs of each repetition are scaled by ``t_full`` over the loop's own plain step: these runs
    come minutes after the forwards were timed, and the machine's speed drifts between the two (a
    speedup needs only the ratios). So the plain step's overhead is 0, and the others say what the
    loop adds or saves relative to a plain step. That plain step is the mean of two autoregressive
    runs, one just before and one just after the repetition's draft runs (each AR run but the first
    and the last serves two repetitions), and the drafts run in rotating order: one AR run a
    repetition, as its only reference, moved every overhead of the repetition by its own noise
    (a 24-token AR run's step varied by +-9% within a minute on a shared 2-core VM, and the verify
    overhead measured that way read -14 to +8 ms over eight measurements: docs/log.md).
    """
    n = costs.num_layers
    base = DecodeConfig(max_new_tokens=tokens, k=3, fallback=False)
    specs = {weight_format(o): DraftSpec(SkipPlan(n), DraftOptions(weights=o.weights, group_size=o.group_size), k=3)
             for o in formats}
    specs.setdefault("model", DraftSpec(SkipPlan(n), k=3))
    paths = {fmt: DraftPath(model, spec.plan, spec.options, stop_ids=stop_ids) for fmt, spec in specs.items()}
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    def ar_step(cfg: DecodeConfig = base) -> float | None:
        st = autoregressive(model, prompt, cfg, stop_ids).stats
        return st.step_time / st.plain_steps if st.plain_steps else None

    def speculate(fmt: str, cfg: DecodeConfig = base):
        return self_speculative(model, prompt, specs[fmt].plan, cfg, stop_ids, draft=paths[fmt]).stats

    warm = replace(base, max_new_tokens=4)  # kernels, the draft weights and heads in place, caches touched
    ar_step(warm)
    for fmt in specs:
        speculate(fmt, warm)
    before = ar_step()
    for rep in range(reps):
        runs = {fmt: speculate(fmt) for fmt in rotated(list(specs), rep)}
        start, before = before, ar_step()  # the AR run after this repetition comes before the next one
        if start is None or before is None or not all(r.rounds for r in runs.values()):
            continue
        scale = costs.t_full / ((start + before) / 2)  # this repetition's seconds -> the forwards' pass
        add("plain_step", 0.0)
        for fmt, st in runs.items():
            add("draft_step", (scale * st.draft_time - costs.draft_forwards(specs[fmt], st.drafted, st.rounds)) / st.drafted)
            verify = scale * st.verify_time / st.rounds - costs.verify_time(round(st.drafted / st.rounds) + 1)
            add("verify", verify)  # pooled over the formats, for reports
            add(f"verify/{fmt}", verify)  # after this format's draft steps, as the cost model prices it
    out = {name: statistics.median(values) for name, values in samples.items()}
    out["adaptive_step"] = confidence_cost(model)
    return out


def confidence_cost(model, reps: int = 31) -> float:
    """Seconds the adaptive exit adds to a draft step: the confidence of the drafted token, computed as the
    decoding loop computes it (:meth:`~selfspec.engine.speculate.Speculator.draft`), on a vocabulary-sized row
    (median of ``reps``)."""
    head = model.get_output_embeddings()
    logits = torch.randn(head.weight.shape[0], dtype=head.weight.dtype, device=head.weight.device)
    clock, times = Clock(logits.device), []
    for _ in range(reps + 1):
        t0 = clock.now()
        float(logits.float().softmax(-1).max())
        times.append(clock.now() - t0)
    return statistics.median(times[1:])


def costs_for_drafts(lm, context: list[int], drafts: list[DraftSpec]) -> CostModel:
    """A cost model measured now over what ``drafts`` use (as the search measures it for its space), for scripts
    that price drafts on this machine and the kernels checked out; ``lm``: a loaded model, ``context`` one
    prompt and its continuation."""
    opts = [d.options for d in drafts]
    formats = {weight_format(o): DraftOptions(weights=o.weights, group_size=o.group_size) for o in opts}
    formats.setdefault("model", DraftOptions())
    heads = [DraftOptions(head_weights=o.head_weights, group_size=o.group_size, head_rescore=o.head_rescore)
             for o in opts if o.head_weights != "model"]
    longest = max(d.options.longest_verify(d.longest_draft) for d in drafts)
    return measure_costs(lm.model, context, list(formats.values()), sorted({0, *(o.head_tokens for o in opts)}),
                         longest + 1, stop_ids=lm.eos_ids, machine=machine_fingerprint(), head_formats=heads)
