"""The search space: the whole self-draft.

- which attention and which MLP sublayers to skip (``attn_i`` / ``mlp_i``, one boolean
  each for the searchable layers; first and last protected by default; a draft outside
  ``min_skipped..max_skipped`` is pruned unscored by the study), and whether to skip at all
  (``skipping``: a draft that skips nothing is one value away, where 52 independent bits
  drawn at random skip about half the sublayers and almost never none);
- the draft options and length policy (:class:`DraftDims`): precision of the kept
  weights, int4 group size, draft head size, k, the adaptive exit and its threshold,
  copy drafting (n-gram size, longest copy, copy length per matched token, copy only or with model drafts),
  and draft trees (copy candidates, branching threshold, node budget: :mod:`selfspec.engine.tree`).

Each option dimension is a list of values; a list of one value fixes it (no Optuna
parameter is made for it), e.g. ``weights: [model]`` for a pure layer-skip search as
the papers run it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import optuna

from selfspec.draft.lowbit import FITS
from selfspec.draft.path import DEFAULT_THRESHOLD_STEP, WEIGHTS, DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.errors import SelfSpecError
from selfspec.model.plan import SkipPlan

# Generic drafts a study runs first (``search.anchors``), as value preferences per dimension: the first
# preferred value the space holds, else the space's first. They are not tuned to a model: the first is
# the cheapest skip-free model draft with copies, the kind every search on these CPUs ended near when it
# found it, and which 100 TPE trials did not always reach (docs/log.md); the second copies only, as
# prompt lookup does. TPE then searches around whichever scores best.
ANCHORS: tuple[dict[str, tuple], ...] = (
    {"skipping": (False,), "weights": ("int4", "int8"), "group_size": (128,), "head_tokens": (0,),
     "head_weights": ("int4", "int8"), "k": (3, 2), "adaptive": (False,), "ngram": (8, 4, 3),
     "copy_tokens": (10, 5), "min_ngram": (2, 1), "copy_per_match": (2,), "copy_candidates": (1,),
     "branch_below": (0.0,), "model_draft": (True,)},
    {"model_draft": (False,), "ngram": (8, 4, 3), "copy_tokens": (10, 5), "min_ngram": (1, 2),
     "copy_per_match": (2,), "copy_candidates": (1,)},
)


def fitting_groups(dims: DraftDims, width: int) -> DraftDims:
    """``dims`` without the int4 group sizes that do not divide ``width`` (the greatest common divisor of the model's
    linear inputs: a tiny model's 64 take groups of 32, not 128); unchanged where none would be left."""
    fit = tuple(g for g in dims.group_size if width % g == 0)
    return replace(dims, group_size=fit) if fit and fit != dims.group_size else dims


def fitting_heads(dims: DraftDims, ranked: bool) -> DraftDims:
    """``dims`` without ``head_ids: frequent`` where the model carries no token ranking (``ranked`` false) and a cut
    head is searched: its cut heads take their lowest ids; unchanged otherwise."""
    if ranked or "frequent" not in dims.head_ids or not any(dims.head_tokens):
        return dims
    return replace(dims, head_ids=tuple(i for i in dims.head_ids if i != "frequent") or ("lowest",))


@dataclass(frozen=True)
class DraftDims:
    weights: tuple[str, ...] = ("model", "int8", "int4")
    group_size: tuple[int, ...] = (32, 128)  # int4 groups; 32 lines up with the GGUF blocks of the packaged models
    int4_fit: tuple[str, ...] = ("minmax",)  # int4 groups' scale and zero: lowbit.FITS
    head_tokens: tuple[int, ...] = (0, 16384, 32768, 65536)
    head_ids: tuple[str, ...] = ("lowest", "frequent")  # a cut head's base: lowest | frequent (path.HEAD_IDS)
    head_weights: tuple[str, ...] = ("model", "int4")  # the draft head's rows: model | int8 | int4 (int4: group_size)
    head_rescore: tuple[int, ...] = (8,)  # a quantized head's top ids rescored on the model's rows (0 = off)
    k: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
    k_max: tuple[int, ...] = (0,)  # a model draft grows past k while rounds are accepted whole, up to this (0: never)
    adaptive: tuple[bool, ...] = (False, True)
    threshold: tuple[float, ...] = (0.2, 0.4, 0.6)
    threshold_step: tuple[float, ...] = (DEFAULT_THRESHOLD_STEP, 0.0)  # the exit's threshold moves by this a round (0: fixed)
    ngram: tuple[int, ...] = (0, 2, 3, 4, 8)  # 8: the longest match of up to 8 tokens picks the occurrence (min_ngram)
    copy_tokens: tuple[int, ...] = (0, 5, 10)
    min_ngram: tuple[int, ...] = (0, 1, 2)  # shortest match copied when the n-gram has none (m < ngram; 0 = n-gram only)
    copy_per_match: tuple[int, ...] = (0, 2)  # c: a match of m tokens copies at most c*m tokens (0 = up to the limit)
    copy_candidates: tuple[int, ...] = (1, 3)  # draft trees: distinct copy continuations verified at once
    branch_below: tuple[float, ...] = (0.0, 0.3)  # draft trees: 2nd-best token where the draft is less sure
    tree_nodes: tuple[int, ...] = (6, 12)  # draft trees: most nodes one verify covers
    copy_fallback: tuple[int, ...] = (0,)  # draft trees: m-gram copies beside a model draft (m < ngram; 0 = off)
    model_draft: tuple[bool, ...] = (True, False)  # False: copy drafting only, a plain step where nothing matched
    skipping: tuple[bool, ...] = (True, False)  # False: no sublayer skipped (the draft saves by its options alone)

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self)):
            if not getattr(self, name):
                raise SelfSpecError(f"search.space.{name} is empty: give at least one value")
        for name, known in (("weights", WEIGHTS), ("head_weights", WEIGHTS), ("int4_fit", FITS)):
            bad = [w for w in getattr(self, name) if w not in known]
            if bad:
                raise SelfSpecError(f"search.space.{name}: unknown {bad}; choose from {', '.join(known)}")
        for name in ("k", "copy_candidates", "tree_nodes"):
            if min(getattr(self, name)) < 1:
                raise SelfSpecError(f"search.space.{name} values must be >= 1")
        for name in ("copy_per_match", "head_rescore", "k_max"):
            if min(getattr(self, name)) < 0:
                raise SelfSpecError(f"search.space.{name} values must be >= 0 (0: off)")
        if not all(0.0 <= s < 1.0 for s in self.threshold_step):
            raise SelfSpecError("search.space.threshold_step values must be in [0, 1) (0: a fixed threshold)")
        if True not in self.model_draft and 0 in self.ngram:
            raise SelfSpecError("search.space.model_draft=[false] searches copy-only drafts, but search.space.ngram "
                                "holds 0 (no copying), which only a model draft can run: drop 0 from it, "
                                "e.g. 'search.space.ngram=[2,3,4,8]'")

    @property
    def longest_verify(self) -> int:
        """The most tokens a verify forward of any draft in the space covers."""
        trees = max(self.copy_candidates) > 1 and max(self.ngram) or max(self.branch_below) > 0 \
            or max(self.copy_fallback) > 0
        return max(max(self.k), max(self.k_max), max(self.copy_tokens) if max(self.ngram) else 0,
                   max(self.tree_nodes) if trees else 0) + 1

    def formats(self) -> list[DraftOptions]:
        """One DraftOptions per weight format in the space (int4 once per group size)."""
        out = []
        for w in self.weights:
            for g in (self.group_size if w == "int4" else (32,)):
                out.append(DraftOptions(weights=w, group_size=g))
        return out

    def head_formats(self) -> list[DraftOptions]:
        """One DraftOptions per quantized draft head format in the space (int4 once per group size), each with and
        without the space's rescoring (the ablation prices a draft without it)."""
        return [DraftOptions(head_weights=w, group_size=g, head_rescore=r) for w in self.head_weights if w != "model"
                for g in (self.group_size if w == "int4" else (32,)) for r in sorted({0, *self.head_rescore})]


@dataclass(frozen=True)
class SearchSpace:
    num_layers: int
    min_skipped: int = 0
    max_skipped: int | None = None
    protect_first_last: bool = True
    dims: DraftDims = field(default_factory=DraftDims)

    @property
    def searchable(self) -> list[int]:
        lo, hi = (1, self.num_layers - 1) if self.protect_first_last else (0, self.num_layers)
        return list(range(lo, hi))

    @property
    def upper(self) -> int:
        n = 2 * len(self.searchable)
        cap = 2 * self.num_layers - 1  # a plan must keep one sublayer
        return min(n, cap, self.max_skipped if self.max_skipped is not None else n)

    def check(self) -> None:
        if self.min_skipped < 0 or (self.max_skipped is not None and self.max_skipped < 0):
            raise SelfSpecError("search budget bounds must be >= 0")
        if not self.searchable:
            raise SelfSpecError("no layer is searchable: the model has too few layers to protect first and last")
        if self.upper < self.min_skipped:
            raise SelfSpecError(
                f"the search budget allows no plan: min_skipped={self.min_skipped}, "
                f"max_skipped={self.max_skipped}, {2 * len(self.searchable)} searchable sublayers"
            )

    def within(self, plan: SkipPlan) -> bool:
        return self.min_skipped <= plan.n_skipped <= self.upper

    def describe(self) -> dict:
        """What the study pins: a resumed study refuses another space."""
        return {"num_layers": self.num_layers, "min_skipped": self.min_skipped, "max_skipped": self.max_skipped,
                "protect_first_last": self.protect_first_last,
                # copy_fallback, min_ngram, copy_per_match, head_weights, model_draft, skipping, int4_fit,
                # head_rescore, head_ids, k_max and threshold_step only when searched or set, so studies made before
                # them still resume
                "dims": {k: list(v) for k, v in asdict(self.dims).items()
                         if (k, v) not in (("copy_fallback", (0,)), ("min_ngram", (0,)), ("copy_per_match", (0,)),
                                           ("head_weights", ("model",)), ("model_draft", (True,)),
                                           ("skipping", (True,)), ("int4_fit", ("minmax",)),
                                           ("head_rescore", (0,)), ("head_ids", ("lowest",)),
                                           ("k_max", (0,)), ("threshold_step", (DEFAULT_THRESHOLD_STEP,)))}}

    # -- params <-> drafts -------------------------------------------------------------
    def _option_dims(self) -> dict[str, tuple]:
        d = self.dims
        # a draft that skips nothing is outside a budget of min_skipped > 0: not a value to search then
        skipping = tuple(v for v in d.skipping if v or not self.min_skipped) or (True,)
        return {"weights": d.weights, "group_size": d.group_size, "int4_fit": d.int4_fit, "head_tokens": d.head_tokens,
                "head_ids": d.head_ids, "head_weights": d.head_weights, "head_rescore": d.head_rescore, "k": d.k,
                "k_max": d.k_max, "adaptive": d.adaptive, "threshold": d.threshold, "threshold_step": d.threshold_step,
                "ngram": d.ngram,
                "copy_tokens": d.copy_tokens,
                "min_ngram": d.min_ngram, "copy_per_match": d.copy_per_match, "copy_candidates": d.copy_candidates,
                "branch_below": d.branch_below,
                "tree_nodes": d.tree_nodes,
                "copy_fallback": d.copy_fallback, "model_draft": d.model_draft, "skipping": skipping}

    def params_of(self, spec: DraftSpec) -> dict:
        params = {**{f"attn_{i}": int(i in spec.plan.attn) for i in self.searchable},
                  **{f"mlp_{i}": int(i in spec.plan.mlp) for i in self.searchable}}
        o = spec.options
        values = {"weights": o.weights, "group_size": o.group_size, "int4_fit": o.int4_fit, "head_tokens": o.head_tokens,
                  "head_ids": o.head_ids, "head_weights": o.head_weights, "head_rescore": o.head_rescore, "k": spec.k,
                  "k_max": spec.k_max, "adaptive": spec.adaptive,
                  "threshold": spec.threshold, "threshold_step": spec.threshold_step, "ngram": o.ngram,
                  "copy_tokens": o.copy_tokens,
                  "min_ngram": o.min_ngram, "copy_per_match": o.copy_per_match, "copy_candidates": o.copy_candidates,
                  "branch_below": o.branch_below,
                  "tree_nodes": o.tree_nodes,
                  "copy_fallback": o.copy_fallback, "model_draft": o.model_draft,
                  "skipping": spec.plan.n_skipped > 0}
        unused = {"group_size": not o.int4, "int4_fit": not o.int4, "threshold": not spec.adaptive,
                  "threshold_step": not spec.adaptive,
                  "head_rescore": o.head_weights == "model", "head_ids": not o.head_tokens,
                  "copy_tokens": not o.ngram, "min_ngram": o.ngram < 2, "copy_per_match": not o.ngram,
                  "copy_candidates": not o.ngram, "tree_nodes": not o.tree, "copy_fallback": o.ngram < 2,
                  "model_draft": not o.ngram, "k_max": not o.model_draft}
        if not spec.plan.n_skipped and False not in self._option_dims()["skipping"]:
            unused["skipping"] = True  # the bits, all off, say it: a space that always skips still holds the draft
        if not o.model_draft:  # a copy-only draft has no model draft to shape
            unused.update(dict.fromkeys(("weights", "group_size", "int4_fit", "head_tokens", "head_ids", "head_weights",
                                         "head_rescore",
                                         "adaptive", "threshold", "threshold_step", "branch_below", "copy_fallback",
                                         "skipping"), True))
            unused["k"] = bool(o.copy_tokens)
        for name, choices in self._option_dims().items():
            if unused.get(name):  # a value the draft does not use: any of the space's will do
                values[name] = choices[0]
            if values[name] not in choices:
                raise SelfSpecError(f"warm start {spec.describe()}: {name}={values[name]!r} "
                                    f"is outside the space {list(choices)}")
            if len(choices) > 1:
                params[name] = values[name]
        return params

    def spec_of(self, params: dict, model: str | None = None) -> DraftSpec:
        v = {name: params.get(name, choices[0]) for name, choices in self._option_dims().items()}
        attn = tuple(i for i in self.searchable if params.get(f"attn_{i}") and v["skipping"])
        mlp = tuple(i for i in self.searchable if params.get(f"mlp_{i}") and v["skipping"])
        min_ngram = v["min_ngram"] if v["min_ngram"] < v["ngram"] else 0
        shortest = min_ngram or v["ngram"]
        if v["ngram"] and not v["model_draft"]:
            # copy only: no sublayer skipped and the model's own draft settings, so that all copy-only
            # trials that copy alike are one draft (one key)
            attn = mlp = ()
            v.update(weights="model", head_tokens=0, head_weights="model", adaptive=False, branch_below=0.0,
                     copy_fallback=0)
            if v["copy_tokens"]:  # k only sets the copy length when copy_tokens is 0
                v["k"] = self.dims.k[0]
        int4 = "int4" in (v["weights"], v["head_weights"])
        options = DraftOptions(weights=v["weights"], group_size=v["group_size"], head_tokens=v["head_tokens"],
                               head_ids=v["head_ids"] if v["head_tokens"] else "lowest",
                               head_weights=v["head_weights"], int4_fit=v["int4_fit"] if int4 else "minmax",
                               head_rescore=v["head_rescore"] if v["head_weights"] != "model" else 0,
                               ngram=v["ngram"], copy_tokens=v["copy_tokens"] if v["ngram"] else 0, min_ngram=min_ngram,
                               copy_per_match=v["copy_per_match"] if v["ngram"] else 0,
                               copy_candidates=v["copy_candidates"] if v["ngram"] else 1,
                               branch_below=v["branch_below"],
                               copy_fallback=v["copy_fallback"] if v["copy_fallback"] < shortest else 0,
                               model_draft=v["model_draft"] or not v["ngram"])
        if options.tree:  # a chain keeps the default budget: one draft, one spec
            options = replace(options, tree_nodes=v["tree_nodes"])
        return DraftSpec(SkipPlan(self.num_layers, attn=attn, mlp=mlp, model=model), options, k=v["k"],
                         adaptive=v["adaptive"], threshold=v["threshold"] if v["adaptive"] else 0.5,
                         threshold_step=v["threshold_step"] if v["adaptive"] else DEFAULT_THRESHOLD_STEP,
                         k_max=v["k_max"] if options.model_draft else 0)  # copies only: nothing grows

    def anchors(self) -> list[DraftSpec]:
        """The :data:`ANCHORS` this space holds (each once), as drafts to enqueue first."""
        out = []
        for prefs in ANCHORS:
            v = {name: next((p for p in prefs.get(name, ()) if p in choices), choices[0])
                 for name, choices in self._option_dims().items()}
            spec = self.spec_of(v)  # no attn_i / mlp_i bit set: nothing skipped
            o = spec.options
            saves = not o.model_draft or o.weights != "model"  # a full-depth full-precision draft saves nothing
            if saves and self.within(spec.plan) and spec.key not in {a.key for a in out}:
                out.append(spec)
        return out

    def suggest(self, trial: optuna.Trial, model: str | None) -> DraftSpec:
        params = {}
        for kind in ("attn", "mlp"):
            for i in self.searchable:
                params[f"{kind}_{i}"] = trial.suggest_categorical(f"{kind}_{i}", [0, 1])
        for name, choices in self._option_dims().items():
            if len(choices) > 1:
                params[name] = trial.suggest_categorical(name, list(choices))
        return self.spec_of(params, model)
