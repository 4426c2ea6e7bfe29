"""A cheaper draft through the same model: fewer sublayers, lower-precision weights, a cut LM head.

Self-speculative drafting runs the target model with the plan's sublayers
skipped. :class:`DraftPath` makes each draft step cheaper still, without a
second model and without touching what verification computes:

- ``weights: int8 | int4``: the linear layers of the *kept* sublayers get a
  weight-only quantized copy (int8 with one scale per output row, through
  ``torch.ops.aten._weight_int8pack_mm``; int4 with asymmetric groups of
  ``group_size``, through :mod:`selfspec.kernels.vnni` where the CPU has AVX-512
  VNNI, else ``_weight_int4pack_mm_for_cpu``) used only while drafting.
  Decode steps are memory-bound, so reading a half or a quarter of the bytes
  makes a draft step about that much cheaper. The copies are extra
  memory and are reported (:attr:`DraftPath.extra_bytes`).
- ``head_tokens: N``: while drafting, the LM head scores only N token ids (its
  base: with ``head_ids: lowest`` the lowest ids, which byte-pair merge order
  makes roughly the most frequent ones; with ``head_ids: frequent`` the ids the
  tokenizer emits most often in packaged text, :mod:`selfspec.assets.vocab`),
  plus the prompt's own tokens and the stop tokens; the others get ``-inf``.
  The full head of a 150k-token vocabulary costs as much as a few layers.
- ``head_weights: int8 | int4``: the draft head (cut or full) scores its base
  ids through a quantized copy of their rows (:mod:`selfspec.draft.head`);
  ``model`` (the default) keeps them in the model's precision.
- ``ngram: n``: when the last n tokens occurred earlier in the context, the
  round drafts by copying what followed them (prompt lookup, :class:`NGramIndex`),
  up to ``copy_tokens`` tokens (default: k), and runs no draft forward at all;
  with ``min_ngram: m``, a context with no n-gram match falls back to the longest
  match of n-1 .. m tokens before the model drafts; with ``copy_per_match: c`` a match
  of m tokens copies at most c*m tokens; with ``model_draft: false`` the
  model never drafts: a round with no match takes a plain step (copy drafting alone,
  as prompt lookup runs it).

Both are switched on only inside ``with path.drafting():`` (together with the
skip plan) by wrapping modules of *that* model instance in place, as
:mod:`selfspec.draft.skip` does; outside the block every module computes exactly
what it computed before. Verification stays the full model, so greedy output
is unchanged and sampling keeps the target distribution: the draft only
proposes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

from selfspec.assets.vocab import frequent_base, rank_of
from selfspec.draft import fused
from selfspec.draft.head import CutHead
from selfspec.draft.lowbit import FEWER_LEVELS, FITS, LowPrecisionLinear, copy_key, wrap_linears
from selfspec.draft.skip import layer_skipper
from selfspec.draft.sparse import top_channels
from selfspec.errors import SelfSpecError
from selfspec.model.plan import SkipPlan
from selfspec.model.wrap import set_plain

WEIGHTS = ("model", "int8", "int4")
HEAD_IDS = ("lowest", "frequent")  # a cut head's base ids (head_ids)
# the draft-length policy's defaults, read by the draft file (DraftSpec) and the decoding loop (DecodeConfig)
DEFAULT_K = 4  # draft tokens per round
DEFAULT_ADAPTIVE = False  # the adaptive exit: stop drafting after a token the draft is unsure of
DEFAULT_THRESHOLD = 0.5  # the adaptive exit's starting threshold
# after each round the adaptive exit's threshold moves by this toward the running acceptance's target; 0 = fixed
DEFAULT_THRESHOLD_STEP = 0.05
DEFAULT_K_MAX = 0  # a model draft grows past k, one token after each round accepted whole, up to this (0: no growth)


@dataclass(frozen=True)
class DraftOptions:
    weights: str = "model"  # model | int8 | int4: precision of the kept linears while drafting
    group_size: int = 32  # int4 quantization group (along the input dimension)
    head_tokens: int = 0  # 0 = the full LM head while drafting; N = N token ids + prompt + stop tokens
    # which N ids a cut head scores: lowest (the N lowest ids) | frequent (the N ids the tokenizer emits most often
    # in packaged text, then the lowest others: selfspec.assets.vocab)
    head_ids: str = "lowest"
    head_weights: str = "model"  # model | int8 | int4 (group_size): precision of the draft head's rows
    # R >= 1 with a quantized head: the R ids it scores highest are scored again on the model's bf16 rows (R rows
    # read a step), so that the draft's choice among its top candidates is the model head's; 0 = off
    head_rescore: int = 0
    # how int4 groups (weights and head) take their scale and zero: minmax (each group's range in 16 even steps) |
    # lsq (refitted to the weights by least squares: a smaller error, the same bytes and kernel; slower to build) |
    # grid (lsq, or a group's own 4-bit grid where it has one: a 4-bit checkpoint's blocks come back as they were)
    int4_fit: str = "minmax"
    ngram: int = 0  # 0 = off; n >= 1: draft by copying what followed the last n tokens in the context
    copy_tokens: int = 0  # longest copy draft; 0 = k, like the layer-skip draft
    # m < ngram: with no n-gram match, copy after the longest match of ngram-1 .. m tokens before drafting
    # with the model (prompt lookup's rule, its max_matching_ngram_size down to m); 0 = n-gram matches only
    min_ngram: int = 0
    # c >= 1: a copy after a match of m tokens drafts at most c*m tokens (and at most copy_tokens, or k); short
    # matches are wrong more often and a long wrong copy widens the verify for nothing; 0 = every match copies alike
    copy_per_match: int = 0
    # draft trees (greedy or sampling; selfspec.engine.tree): several candidates in one verify forward
    copy_candidates: int = 1  # distinct continuations of earlier n-gram matches, latest first; 1 = a chain
    branch_below: float = 0.0  # model drafts add the 2nd-best token where the top probability is below this
    tree_nodes: int = 12  # most drafted nodes a tree verifies at once; its first candidate goes in whole (docs/log.md)
    # a round with no n-gram match also verifies, beside the model draft, the continuations (up to
    # copy_candidates) of earlier occurrences of the last m tokens, m < ngram (1 = prompt lookup's last resort)
    copy_fallback: int = 0
    # False: copy drafting only (prompt lookup's rule): a round with no copy match takes a plain step instead of
    # drafting with the model, so the skip plan, draft weights and head are unused (needs ngram)
    model_draft: bool = True
    # kept Llama/Qwen2 sublayers whose int4 copies run on the VNNI kernel draft as one C++ call each
    # (selfspec.draft.fused; the same numbers up to rounding); False: through the modules, e.g. to measure what it adds
    fused: bool = True
    # with fused sublayers, a whole draft step of a Llama/Qwen2 model as one call per kept sublayer, its norm and
    # residual add included (selfspec.draft.fused.FusedStep); False: the fused calls inside the model's forward
    fused_step: bool = True
    # f < 1: each kept gated MLP keeps the fraction f of a token's channels with the largest |act(gate(x))| and zeroes
    # the rest (selfspec.draft.sparse), run through the modules; what a kernel reading (1 + 2f)/3 of the MLP's bytes
    # would draft (a measurement for the route bounds: no kernel here reads fewer bytes); 1 = every channel
    mlp_keep: float = 1.0

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise SelfSpecError(f"draft weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.head_weights not in WEIGHTS:
            raise SelfSpecError(f"head_weights must be one of {', '.join(WEIGHTS)}, got {self.head_weights!r}")
        if self.head_tokens < 0 or self.ngram < 0 or self.copy_tokens < 0 or self.copy_per_match < 0:
            raise SelfSpecError("head_tokens, ngram, copy_tokens and copy_per_match must be >= 0")
        if self.head_ids not in HEAD_IDS:
            raise SelfSpecError(f"head_ids must be one of {', '.join(HEAD_IDS)}, got {self.head_ids!r}")
        if self.head_ids != "lowest" and not self.head_tokens:
            raise SelfSpecError(f"head_ids={self.head_ids} chooses a cut head's ids: it needs head_tokens N >= 1")
        if self.head_rescore < 0 or (self.head_rescore and self.head_weights == "model"):
            raise SelfSpecError(f"head_rescore must be 0, or >= 1 with a quantized head (head_weights int8 or int4): "
                                f"got {self.head_rescore} with head_weights={self.head_weights}")
        if self.copy_candidates < 1 or self.tree_nodes < 1:
            raise SelfSpecError("copy_candidates and tree_nodes must be >= 1")
        if not 0.0 <= self.branch_below < 1.0:
            raise SelfSpecError(f"branch_below must be in [0, 1), got {self.branch_below}")
        if self.min_ngram and not 0 < self.min_ngram < self.ngram:
            raise SelfSpecError(f"min_ngram must be between 1 and ngram-1 (ngram={self.ngram}), or 0 for "
                                f"n-gram matches only; got {self.min_ngram}")
        shortest = self.min_ngram or self.ngram
        if self.copy_fallback and not 0 < self.copy_fallback < shortest:
            raise SelfSpecError(f"copy_fallback must be between 1 and {shortest - 1} (below the shortest match "
                                f"copied: ngram={self.ngram}, min_ngram={self.min_ngram}), got {self.copy_fallback}")
        for name in ("model_draft", "fused", "fused_step"):
            if not isinstance(getattr(self, name), bool):
                raise SelfSpecError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.model_draft and not self.ngram:
            raise SelfSpecError("model_draft=false drafts by copying only: it needs copy drafting (ngram >= 1)")
        if not 0.0 < self.mlp_keep <= 1.0:
            raise SelfSpecError(f"mlp_keep must be in (0, 1], got {self.mlp_keep}")
        if self.int4_fit not in FITS:
            raise SelfSpecError(f"int4_fit must be one of {', '.join(FITS)}, got {self.int4_fit!r}")
        if self.int4 and self.group_size not in (32, 64, 128, 256):
            raise SelfSpecError(f"int4 group_size must be 32, 64, 128 or 256, got {self.group_size}")

    def copy_limit(self, k: int) -> int:
        """The longest copy draft of a round drafting ``k`` tokens: ``copy_tokens``, or k where it is 0."""
        return self.copy_tokens or k

    def longest_verify(self, k: int) -> int:
        """The most drafted tokens one verify forward checks with draft length ``k``: the model draft's k, a copy
        (with copy drafting) or a tree's nodes (with trees), whichever is longest; the forward adds the pending token."""
        return max(k, self.copy_limit(k) if self.ngram else 0, self.tree_nodes if self.tree else 0)

    def group_for(self, fmt: str) -> int:
        """The quantization group of a weight format: ``group_size`` for int4, 0 (per row) for int8 and model."""
        return self.group_size if fmt == "int4" else 0

    @property
    def int4(self) -> bool:
        """Whether the draft keeps int4 copies (of its weights or its head): where group_size and int4_fit apply."""
        return "int4" in (self.weights, self.head_weights)

    @property
    def plain(self) -> bool:
        return self.weights == "model" and self.head_tokens == 0 and self.head_weights == "model"

    @property
    def tree(self) -> bool:
        """Whether rounds may verify a tree of candidates instead of a chain."""
        return (self.ngram > 0 and self.copy_candidates > 1) or self.branch_below > 0 or self.copy_fallback > 0

    def record(self) -> dict | None:
        """The options as a run records them (None for the plan-only draft).

        ``copy_tokens``, ``min_ngram``, ``copy_per_match``, ``copy_fallback``, ``head_ids``, ``head_weights``,
        ``head_rescore``, ``int4_fit``, ``model_draft``, ``fused``, ``fused_step``, ``mlp_keep`` and the tree options
        appear only when set, so runs recorded before they existed still resume.
        """
        if self.plain and not self.ngram and not self.tree:
            return None
        rec = asdict(self)
        if self.head_ids == "lowest":
            del rec["head_ids"]
        if self.head_weights == "model":
            del rec["head_weights"]
        if not self.head_rescore:
            del rec["head_rescore"]
        if not self.copy_tokens:
            del rec["copy_tokens"]
        if not self.min_ngram:
            del rec["min_ngram"]
        if not self.copy_per_match:
            del rec["copy_per_match"]
        if not self.copy_fallback:
            del rec["copy_fallback"]
        if self.int4_fit == "minmax":
            del rec["int4_fit"]
        if self.model_draft:
            del rec["model_draft"]
        if self.fused:
            del rec["fused"]
        if self.fused_step:
            del rec["fused_step"]
        if self.mlp_keep == 1.0:
            del rec["mlp_keep"]
        if not self.tree:
            for name in ("copy_candidates", "branch_below", "tree_nodes"):
                del rec[name]
        return rec


def _check_low_precision(model: nn.Module, options: DraftOptions) -> None:
    """int8/int4 draft weights and heads run torch's CPU kernels, which take 16- or 32-bit floats."""
    param = next(model.parameters())
    for name, fmt, what in (("weights", options.weights, "weights"), ("head_weights", options.head_weights, "heads")):
        if fmt != "model" and param.device.type != "cpu":
            raise SelfSpecError(f"int8/int4 draft {what} use CPU kernels; use {name}=model on other devices")
    low = {options.weights, options.head_weights} - {"model"}
    if low and param.dtype == torch.float64:
        raise SelfSpecError(f"{'/'.join(sorted(low))} draft weights run torch's CPU kernels, which take bf16, fp16 or "
                            "fp32 models, not float64: use weights=model and head_weights=model (in a search: "
                            "search.space.weights=[model] search.space.head_weights=[model])")


class DraftPath:
    """The draft-only state of one model for one plan: skips, quantized copies, cut head."""

    def __init__(self, model: nn.Module, plan: SkipPlan, options: DraftOptions, stop_ids=()) -> None:
        self.model = model
        self.plan = plan
        self.options = options
        self.skipper = layer_skipper(model)
        plan.check_model(self.skipper.num_layers)
        self.linears: list[LowPrecisionLinear] = []
        _check_low_precision(model, options)
        self.fused: list[tuple[nn.Module, object]] = []  # (kept sublayer's wrapper, its one-call form)
        if options.weights != "model":
            key = copy_key(options.weights, options.group_size, options.int4_fit)
            kept = [(self.skipper.attn, set(plan.attn), fused.attention_for),
                    (self.skipper.mlp, set(plan.mlp), fused.mlp_for)]
            for subs, off, fuse in kept:
                for i, sub in enumerate(subs):
                    if i not in off:
                        self.linears += wrap_linears(sub.inner, options.weights, options.group_size, options.int4_fit)
                        sparse = options.mlp_keep < 1.0 and fuse is fused.mlp_for  # the modules compute the sparsity
                        fast = fuse(model, sub.inner, key) if options.fused and not sparse else None
                        if fast is not None:
                            self.fused.append((sub, fast))
        self.channels = [top_channels(sub.inner) for i, sub in enumerate(self.skipper.mlp)
                         if i not in plan.mlp] if options.mlp_keep < 1.0 else []
        # the whole draft step as one call per kept sublayer, where every kept one runs fused (fused.FusedStep)
        self.step = fused.step_for(model, self.skipper.arch.layers, plan, {id(sub): fast for sub, fast in self.fused}) \
            if options.weights != "model" and options.fused and options.fused_step else None
        self.head: CutHead | None = None
        self.base_ids: torch.Tensor | None = None
        self.head_low: tuple | None = None  # the quantized copy of the head's base rows (head_weights)
        self.head_choice: tuple | None = None  # what this path's head scores (CutHead.choice), set per request
        if options.head_tokens or options.head_weights != "model":
            head = model.get_output_embeddings()
            if not isinstance(head, CutHead):
                head = CutHead(head)
                model.set_output_embeddings(head)  # the model's own setter: the head may sit anywhere
            self.head = head
            vocab = head.inner.out_features
            n = min(options.head_tokens or vocab, vocab)
            ids = frequent_base(rank_of(model), n, vocab) if options.head_ids == "frequent" else range(n)
            base = set(ids) | {int(i) for i in stop_ids if 0 <= int(i) < vocab}
            self.base_ids = torch.tensor(sorted(base), dtype=torch.long)
            # the head keeps 16 levels where the layers' fit measures fewer (lowbit.FEWER_LEVELS)
            head_fit = "lsq" if options.int4_fit in FEWER_LEVELS else options.int4_fit
            self.head_low = head.copy_for(self.base_ids, options.head_weights, options.group_size, head_fit)

    @property
    def extra_bytes(self) -> int:
        """Memory the draft path keeps beside the model: quantized copies, the cut head's rows.

        Before the first request the head's rows are counted for the base ids
        (a request adds its prompt's tokens).
        """
        head = 0
        if self.head is not None:
            w, low = self.head.inner.weight, self.head_low
            rows = self.head_choice[1] if self.head_choice is not None else None
            if low is None:
                head = (rows.shape[0] if rows is not None else self.base_ids.numel()) * w.shape[1] * w.element_size()
            else:  # the quantized base rows, and a request's extra ids in bf16
                head = sum(t.numel() * t.element_size() for t in low[3:]) + (0 if rows is None else
                                                                             rows.numel() * rows.element_size())
        o = self.options
        return sum(lin.copy_bytes(o.weights, o.group_size, o.int4_fit) for lin in self.linears) + head

    @property
    def kernels(self) -> list[str]:
        """The low-precision kernels this path drafts through (:func:`~selfspec.draft.lowbit.quantize`), sorted."""
        o = self.options
        found = {lin.copy(o.weights, o.group_size, o.int4_fit)[0] for lin in self.linears}
        if self.head_low is not None:
            found.add(self.head_low[0])
        return sorted(found)

    def head_ids(self, prompt: torch.Tensor) -> torch.Tensor:
        """The ids the cut head scores for a request: the base ids and the prompt's own tokens."""
        return torch.cat([self.base_ids.to(prompt.device), prompt.reshape(-1)]).unique()

    def prepare(self, prompt: torch.Tensor) -> None:
        """Per request: the cut head also scores the prompt's tokens (copying them is common)."""
        if self.head is not None:
            self.choose_head(self.head_ids(prompt))

    def choose_head(self, ids: torch.Tensor) -> None:
        """The draft head scores ``ids`` (in this path's head precision) whenever this path drafts."""
        self.head_choice = self.head.choice(ids, self.head_low)

    @contextmanager
    def drafting(self) -> Iterator[None]:
        """Draft through this path. The low-precision wrappers and the cut head belong to the model and
        are shared by all its paths (a search or a comparison builds several): each path puts its own
        weight format and head choice in place here, so the last path built never drafts for the others."""
        with self.skipper.skipping(self.plan):
            try:
                for lin in self.linears:
                    lin.configure(self.options.weights, self.options.group_size, self.options.int4_fit)
                    set_plain(lin, active=True)
                for sub, fast in self.fused:
                    set_plain(sub, fast=fast)
                for act in self.channels:
                    set_plain(act, keep=self.options.mlp_keep)
                if self.step is not None:
                    set_plain(self.model, **{fused.STEP: self.step})
                if self.head is not None:
                    if self.head_choice is None:  # no request prepared yet: the base ids alone
                        self.choose_head(self.base_ids)
                    self.head.use(self.head_choice)
                    set_plain(self.head, active=True, rescore=self.options.head_rescore)
                yield
            finally:
                for lin in self.linears:
                    set_plain(lin, active=False)
                    if lin.shared is not None:
                        lin.shared.forget()
                for sub, _ in self.fused:
                    set_plain(sub, fast=None)
                for act in self.channels:
                    set_plain(act, keep=1.0)
                set_plain(self.model, **{fused.STEP: None})
                if self.head is not None:
                    set_plain(self.head, active=False)
