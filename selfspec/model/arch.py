"""Per-architecture accessors: where the decoder layers and their sublayers are.

Each supported architecture needs only the path to its list of decoder
layers and the attribute names of the attention and MLP submodules; no
modeling code is copied. To support a new architecture, add a line to
``_SUBLAYERS`` after checking that its decoder layer adds the attention and
MLP outputs to the residual stream (possibly through a norm that maps zero to
zero, as Gemma3's post-norms do), so that a zero output is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from selfspec.errors import SelfSpecError

# model_type -> (attention attribute, MLP attribute); each entry is tested (tests/draft/test_skip.py,
# tests/engine/test_decoding.py) on a tiny model of that architecture
_SUBLAYERS: dict[str, tuple[str, str]] = {
    "llama": ("self_attn", "mlp"),
    "qwen2": ("self_attn", "mlp"),
    "gemma3_text": ("self_attn", "mlp"),
}


@dataclass(frozen=True)
class Arch:
    model_type: str
    layers: nn.ModuleList
    attn_name: str
    mlp_name: str

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def num_layers(model: nn.Module) -> int:
    """Decoder layers of ``model``, from its (text) config: the one place a layer count is read."""
    return model.config.get_text_config(decoder=True).num_hidden_layers


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    for path in ("model.layers", "model.language_model.layers", "model.decoder.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise SelfSpecError(f"cannot find the decoder layers of {type(model).__name__}")


def arch_of(model: nn.Module) -> Arch:
    """Describe ``model``'s decoder layers, or raise a clear error for unsupported ones."""
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in _SUBLAYERS:
        raise SelfSpecError(
            f"architecture {model_type!r} is not supported yet (supported: {', '.join(sorted(_SUBLAYERS))}); "
            "add its sublayer names to selfspec/model/arch.py"
        )
    attn, mlp = _SUBLAYERS[model_type]
    return Arch(model_type, _decoder_layers(model)[: num_layers(model)], attn, mlp)
