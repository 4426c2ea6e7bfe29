"""Skip attention / MLP sublayers of one model instance while drafting.

:func:`layer_skipper` wraps each decoder layer's attention and MLP submodule
of *that* model in place with a :class:`SkippableSublayer` (no transformers
class is patched, no modeling file is copied, other model instances are
untouched). Skipping is switched on only inside ``with skipper.skipping(plan):``
and always switched off on exit, also when the body raises.

Invariant: a skipped sublayer returns zeros, so the decoder layer adds nothing
to the residual stream (identity), and a skipped attention sublayer never
calls the cache, so it writes nothing to the KV cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from selfspec.model.arch import Arch, arch_of
from selfspec.model.plan import SkipPlan
from selfspec.model.wrap import instance_state, set_plain, wrap_attr


class SkippableSublayer(nn.Module):
    """An attention or MLP submodule that can be turned into the zero map.

    ``returns_tuple`` is true for attention modules, which return
    ``(output, attention_weights)``.
    """

    def __init__(self, inner: nn.Module, returns_tuple: bool) -> None:
        super().__init__()
        self.inner = inner
        self.returns_tuple = returns_tuple
        self.skip = False
        # while drafting, a callable that computes the sublayer in one call (selfspec.draft.fused), None to run
        # the module; it may return None for a forward it does not cover
        self.fast = None

    def forward(self, *args, **kwargs):
        if not self.skip:
            if self.fast is not None:
                out = self.fast(*args, **kwargs)
                if out is not None:
                    return out
            return self.inner(*args, **kwargs)
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        zeros = x.new_zeros(x.shape)
        return (zeros, None) if self.returns_tuple else zeros

    def __getattr__(self, name: str):
        # attributes the surrounding modeling code reads (layer_idx, is_sliding, ...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


class LayerSkipper:
    """Owns the wrapped sublayers of one model; switch plans with :meth:`skipping`."""

    def __init__(self, model: nn.Module) -> None:
        self.arch: Arch = arch_of(model)
        self.attn: list[SkippableSublayer] = []
        self.mlp: list[SkippableSublayer] = []
        for layer in self.arch.layers:
            self.attn.append(wrap_attr(layer, self.arch.attn_name, SkippableSublayer,
                                       lambda m: SkippableSublayer(m, returns_tuple=True)))
            self.mlp.append(wrap_attr(layer, self.arch.mlp_name, SkippableSublayer,
                                      lambda m: SkippableSublayer(m, returns_tuple=False)))
        self.active: SkipPlan | None = None

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @contextmanager
    def skipping(self, plan: SkipPlan) -> Iterator[None]:
        """Within the block, the model runs as the draft described by ``plan``."""
        plan.check_model(self.num_layers)
        if self.active is not None:
            raise RuntimeError("a skip plan is already active on this model; skipping blocks do not nest")
        self.active = plan
        try:
            for i in plan.attn:
                set_plain(self.attn[i], skip=True)
            for i in plan.mlp:
                set_plain(self.mlp[i], skip=True)
            yield
        finally:
            for sub in self.attn + self.mlp:
                set_plain(sub, skip=False)
            self.active = None

    def remove(self) -> None:
        """Put the original submodules back (the model is as it was loaded)."""
        for layer, a, m in zip(self.arch.layers, self.attn, self.mlp):
            setattr(layer, self.arch.attn_name, a.inner)
            setattr(layer, self.arch.mlp_name, m.inner)
        self.attn, self.mlp = [], []


def layer_skipper(model: nn.Module) -> LayerSkipper:
    """The :class:`LayerSkipper` of ``model``, wrapping its sublayers on first use."""
    return instance_state(model, "_selfspec_skipper", lambda: LayerSkipper(model), valid=lambda s: bool(s.attn))

