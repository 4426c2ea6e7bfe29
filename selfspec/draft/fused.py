"""A draft step's sublayers in one C++ call each (``csrc/draft_fused.cpp``: ``draft_attention``, ``draft_mlp``).

A 1.5B int4 draft step spends ~27 ms reading its weights and ~20 ms on everything else: hundreds of small operators
(the rotary embedding, casts, the attention's products over the cache, bias and activation) and the Python around
them (``scripts/profile_draft_step.py``, docs/log.md). Here a kept attention sublayer of a Llama or Qwen2
layer runs as one call while drafting: q/k/v through their stacked int4 copy, the rotary embedding, the keys/values
written into the :class:`~selfspec.engine.cache.PositionalKVCache` slots of the step, causal attention over the
slots before them, o_proj; a kept MLP sublayer likewise (gate/up stacked, SiLU, down). The norms, residuals and
the head stay the model's own modules.

It runs where the draft's copies of the sublayer all run on our int4 kernel (:mod:`selfspec.kernels.vnni`, its AVX-512
VNNI or its AVX2 build) and the sublayer is one this code computes: a Llama/Qwen2 attention without a sliding
window, a head dimension a multiple of 32 and no o_proj bias; a SiLU MLP without biases. Anywhere else, and for any
forward that is not a draft step on the positional cache, the module runs as loaded. The numbers differ from the
module's path only by rounding (fp32 inside the call where the module rounds to bf16 between operators; tested
against it); drafts are proposals, so verification and the output are untouched. ``SELFSPEC_FUSED_DRAFT=0`` turns it
off.

Each call is switched on by :meth:`selfspec.draft.path.DraftPath.drafting` through the sublayer's
:class:`~selfspec.draft.skip.SkippableSublayer` (its ``fast`` attribute); no transformers module is changed.

Where every kept sublayer of a draft runs fused, the whole draft step can skip the modeling code around them too
(:class:`FusedStep`): the decoder layers' norms, residual adds and Python cost a 1.5B int4 draft step ~10 ms of ~67
(docs/log.md). :meth:`~selfspec.draft.path.DraftPath.drafting` puts it on the model
instance (:func:`draft_step`) and :func:`selfspec.engine.decoding.forward_at` runs a causal draft forward on the
positional cache through it; any other forward goes through the model as before.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from selfspec.draft.lowbit import LowPrecisionLinear
from selfspec.engine.cache import PositionalKVCache
from selfspec.kernels import vnni

ENV = "SELFSPEC_FUSED_DRAFT"  # 0: draft through the modules
STEP = "_selfspec_draft_step"  # the model instance's FusedStep while a path that has one drafts
ARCHS = ("llama", "qwen2")  # decoder layers whose attention and MLP this code computes (tests/draft/test_fused.py)


def enabled() -> bool:
    """Whether fused draft sublayers may run here: our int4 kernel runs (either build) and the environment does not
    say 0."""
    return os.environ.get(ENV, "1") != "0" and vnni.available()


def _stacked(lins: list, key: tuple[str, int]) -> tuple | None:
    """The siblings' stacked int4-vnni copy in format ``key`` (:class:`~selfspec.draft.lowbit.SharedInput`)."""
    if not all(isinstance(lin, LowPrecisionLinear) for lin in lins):
        return None
    shared = lins[0].shared
    if shared is None or shared.members != lins or key not in shared.stacked:
        return None
    stacked = shared.stacked[key]
    return stacked if stacked[0] == "int4-vnni" else None


def _single(lin, key: tuple[str, int]) -> tuple | None:
    if not isinstance(lin, LowPrecisionLinear) or lin.inner.bias is not None or key not in lin.copies:
        return None
    kernel, qweight, qscale = lin.copies[key]
    return (qweight, qscale) if kernel == "int4-vnni" else None


def _window(cache, layer: int, rows: int):
    """The cache's keys/values ``[kv_heads, L, D]`` of ``layer`` and the first slot written, for a causal forward
    of ``rows`` rows on a :class:`~selfspec.engine.cache.PositionalKVCache` of one sequence; None for anything else
    (another cache, a forward with its own mask such as the search's teacher-forced chunks)."""
    if not isinstance(cache, PositionalKVCache):
        return None
    window = cache.window
    if not window.causal or window.end - window.start != rows:
        return None
    lay = cache.layers[layer]
    if lay.keys.shape[0] != 1:
        return None
    return lay.keys[0], lay.values[0], window.start


class FusedAttention:
    """A kept Llama/Qwen2 attention sublayer as one call (:func:`attention_for` builds it)."""

    def __init__(self, attn: nn.Module, key: tuple[str, int], qkv: tuple, o: tuple) -> None:
        cfg = attn.config
        self.layer = attn.layer_idx
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.scale = float(attn.scaling)
        self.group = key[1]
        _, _, self.qkv_w, self.qkv_sz, self.qkv_bias = qkv
        self.o_w, self.o_sz = o

    def __call__(self, *args, **kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        emb = kwargs.get("position_embeddings")
        if h.shape[0] != 1 or h.dtype != torch.bfloat16 or emb is None or kwargs.get("output_attentions"):
            return None
        place = _window(cache, self.layer, h.shape[1])
        if place is None:
            return None
        kc, vc, start = place
        cos, sin = emb
        if cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16:  # the operator takes the model's bf16
            return None
        out = torch.ops.selfspec_vnni.draft_attention(h[0].contiguous(), *self._weights(),
                                                      *self._rest(cos[0].contiguous(), sin[0].contiguous(), kc, vc,
                                                                  start))
        return out[None], None

    def block(self, x: torch.Tensor, norm: tuple, rope: tuple, cache, start: int) -> torch.Tensor:
        """``x + attention(rms_norm(x))`` for the rows ``x`` [R, E] at slots ``start..`` (a :class:`FusedStep`'s
        call; ``norm``: the input norm's (weight, eps), ``rope``: the rows' (cos, sin) [R, D])."""
        lay = cache.layers[self.layer]
        return torch.ops.selfspec_vnni.draft_attention_block(x, *norm, *self._weights(),
                                                            *self._rest(*rope, lay.keys[0], lay.values[0], start))

    def _weights(self) -> tuple:
        return self.qkv_w, self.qkv_sz, self.qkv_bias, self.o_w, self.o_sz, self.group

    def _rest(self, cos, sin, kc, vc, start: int) -> tuple:
        return cos, sin, kc, vc, start, self.heads, self.kv_heads, self.scale


class FusedMLP:
    """A kept SiLU MLP sublayer as one call (:func:`mlp_for` builds it)."""

    def __init__(self, key: tuple[str, int], gate_up: tuple, down: tuple) -> None:
        self.group = key[1]
        _, _, self.gu_w, self.gu_sz, _ = gate_up
        self.down_w, self.down_sz = down

    def __call__(self, *args, **kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if h.dtype != torch.bfloat16:
            return None
        shape = h.shape
        out = torch.ops.selfspec_vnni.draft_mlp(h.reshape(-1, shape[-1]).contiguous(), self.gu_w, self.gu_sz,
                                                self.down_w, self.down_sz, self.group)
        return out.reshape(*shape[:-1], out.shape[-1])

    def block(self, x: torch.Tensor, norm: tuple, rope: tuple, cache, start: int) -> torch.Tensor:
        """``x + mlp(rms_norm(x))`` for the rows ``x`` [R, E] (:meth:`FusedAttention.block`'s arguments; ``norm``:
        the post-attention norm's (weight, eps), the rest unused)."""
        return torch.ops.selfspec_vnni.draft_mlp_block(x, *norm, self.gu_w, self.gu_sz, self.down_w, self.down_sz,
                                                      self.group)


def attention_for(model: nn.Module, attn: nn.Module, key: tuple[str, int]) -> FusedAttention | None:
    """The fused form of ``attn`` (the module inside its skip wrapper) for draft copies in format ``key``, or None
    where it does not apply."""
    cfg = model.config
    if not enabled() or cfg.model_type not in ARCHS or getattr(attn, "sliding_window", None) is not None:
        return None
    head_dim = getattr(attn, "head_dim", 0)
    if not head_dim or head_dim % 32 or not hasattr(attn, "layer_idx") or not hasattr(attn, "scaling"):
        return None
    qkv = _stacked([getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")], key)
    o = _single(getattr(attn, "o_proj", None), key)
    if qkv is None or o is None or (qkv[4] is not None and qkv[4].dtype != torch.bfloat16):
        return None  # the operator reads the biases as bf16, as the weights of an int4-vnni copy are
    return FusedAttention(attn, key, qkv, o)


def mlp_for(model: nn.Module, mlp: nn.Module, key: tuple[str, int]) -> FusedMLP | None:
    """The fused form of ``mlp`` for draft copies in format ``key``, or None where it does not apply."""
    cfg = model.config
    if not enabled() or cfg.model_type not in ARCHS or getattr(cfg, "hidden_act", None) != "silu":
        return None
    gate_up = _stacked([getattr(mlp, n, None) for n in ("gate_proj", "up_proj")], key)
    down = _single(getattr(mlp, "down_proj", None), key)
    if gate_up is None or down is None or gate_up[4] is not None:
        return None
    return FusedMLP(key, gate_up, down)


def draft_step(model: nn.Module) -> FusedStep | None:
    """The :class:`FusedStep` switched on for ``model`` (inside a drafting block of a path that has one), else None."""
    return model.__dict__.get(STEP)


def _rms_norm(module: nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of a Llama/Qwen2 RMSNorm in bf16, which the block operators compute as transformers does."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not type(module).__name__.endswith("RMSNorm") or weight is None or eps is None or weight.dtype != torch.bfloat16:
        return None
    return weight.detach().contiguous(), float(eps)


class FusedStep:
    """A whole draft step of a Llama/Qwen2 model whose kept sublayers all run fused (:func:`step_for` builds it).

    What the model's forward computes for a causal forward on the positional cache, without its modeling code around
    the sublayers: the embedding and the rotary embedding through the model's own modules, then, per kept sublayer in
    order, one C++ call that computes the sublayer's RMSNorm, the sublayer, and adds it to the residual stream
    (``draft_attention_block``, ``draft_mlp_block``: the fused calls above with the norm and the add rounded as the
    modules round them), then the final norm and the head (the draft's cut or low-precision head, as it is switched
    on) on the last ``keep`` rows. A skipped sublayer is the identity, as in the model.
    """

    def __init__(self, model: nn.Module, base: nn.Module, blocks: list[tuple]) -> None:
        self.model = model
        self.base = base  # embed_tokens, rotary_emb, norm
        self.blocks = blocks  # (the norm's (weight, eps), FusedAttention | FusedMLP), kept sublayers in order

    def __call__(self, tokens: torch.Tensor, start: int, cache, keep: int) -> torch.Tensor | None:
        """The logits ``[keep, V]`` of the last ``keep`` of ``tokens`` at positions ``start..``, their keys/values
        written to ``cache``; None where this forward is not one this step computes (the caller runs the model)."""
        n = tokens.numel()
        if _window(cache, 0, n) is None or cache.window.start != start:
            return None
        ids = tokens.reshape(1, n)
        h = self.base.embed_tokens(ids)
        if h.dtype != torch.bfloat16:
            return None
        cos, sin = self.base.rotary_emb(h, torch.arange(start, start + n, device=ids.device)[None])
        if cos.dtype != torch.bfloat16:
            return None
        rope = cos[0].contiguous(), sin[0].contiguous()
        x = h[0]
        for norm, sub in self.blocks:
            x = sub.block(x, norm, rope, cache, start)
        x = self.base.norm(x[-keep:][None])
        return self.model.get_output_embeddings()(x)[0]


def step_for(model: nn.Module, layers, plan, fast: dict[int, object]) -> FusedStep | None:
    """The :class:`FusedStep` of a draft with skip ``plan`` over decoder ``layers``, whose kept sublayers' fused forms
    are ``fast`` (keyed by the id of the sublayer's skip wrapper), or None where any kept sublayer or the model's
    structure is one it does not compute."""
    base = getattr(model, "model", None)
    if (not enabled() or model.config.model_type not in ARCHS or base is None
            or any(getattr(base, name, None) is None for name in ("embed_tokens", "rotary_emb", "norm"))
            or getattr(base, "layers", None) is None or base.layers[0] is not layers[0]):
        return None
    blocks = []
    for i, layer in enumerate(layers):
        for sub, norm, off in ((layer.self_attn, layer.input_layernorm, plan.attn),
                               (layer.mlp, layer.post_attention_layernorm, plan.mlp)):
            if i in off:
                continue
            fused, rms = fast.get(id(sub)), _rms_norm(norm)
            if fused is None or rms is None:
                return None
            blocks.append((rms, fused))
    return FusedStep(model, base, blocks)
