"""What each decoder layer of a model is, read per layer from its transformers config: the one accessor for head
sizes, KV heads, sliding windows and layer types (cache, route, bytes per token, reports).

transformers 5.2x configs may be heterogeneous (`config.per_layer_config[i]` overrides fields per layer: Gemma 4's
full-attention layers have their own `head_dim` and `num_key_value_heads`), and then reading such a field on the
whole config raises. A composite config (a vision-language model's) keeps its decoder in `text_config`. Nothing
here reads a per-layer field on the whole config.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

WINDOWED = ("sliding_attention", "chunked_attention")


@dataclass(frozen=True, slots=True)
class LayerShape:
    """One decoder layer's attention, as the config gives it."""

    layer: int
    kind: str  # the config's layer type ("full_attention" where the config names none)
    kv_heads: int | None  # K/V heads (None: not an attention layer the config sizes, e.g. MLA's latent)
    head_dim: int | None  # K/V head size
    window: int | None  # tokens a sliding-window / chunked layer attends to (None: all)

    def __post_init__(self):
        for name in ("kv_heads", "head_dim", "window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"layer {self.layer}: {name} must be a positive int, got {value!r}")


def decoder_config(config):
    """The config of the decoder that holds the KV cache (a composite model's text config)."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def layer_config(config, layer: int):
    """The config as layer `layer` sees it: its per-layer overrides applied (transformers >= 5.2x heterogeneous
    configs), else the decoder config itself."""
    text = decoder_config(config)
    if _is_heterogeneous(text):
        return text.per_layer_config[layer]
    return text


def _is_heterogeneous(config) -> bool:
    try:
        return bool(getattr(config, "is_heterogeneous", False))
    except Exception:  # noqa: BLE001 - a config whose attribute access raises is treated as homogeneous
        return False


def field(config, name: str, default=None, layer: int | None = None):
    """`name` of the decoder config, or of layer `layer`'s view of it; on a heterogeneous config a per-layer field
    asked without a layer is the first layer's (never the whole config's, which raises)."""
    text = decoder_config(config)
    if _is_heterogeneous(text) and name in (text.per_layer_attributes or ()):
        text = text.per_layer_config[0 if layer is None else layer]
    elif layer is not None:
        text = layer_config(config, layer)
    return getattr(text, name, default)


def layer_count(config) -> int:
    """The decoder's layers (a config that gives no count, such as a test's stub, counts as one layer)."""
    return int(field(config, "num_hidden_layers") or 1)


def layer_types(config) -> list[str]:
    """Each layer's type as the config names it ("full_attention" for a config without `layer_types`)."""
    named = field(config, "layer_types")
    return list(named) if named else ["full_attention"] * layer_count(config)


def layer_shape(config, layer: int) -> LayerShape:
    seen = layer_config(config, layer)
    kind = layer_types(config)[layer]
    heads = getattr(seen, "num_attention_heads", None)
    kv_heads = getattr(seen, "num_key_value_heads", None) or heads
    head_dim = getattr(seen, "head_dim", None) or (seen.hidden_size // heads if heads else None)
    if kind in ("sliding_attention", "hybrid_sliding"):  # (hybrid_sliding: a window beside an SSM state, Inkling's)
        window = getattr(seen, "sliding_window", None)
    elif kind == "chunked_attention":
        window = getattr(seen, "attention_chunk_size", None)
    elif not field(config, "layer_types") and getattr(seen, "use_sliding_window", True):  # Mistral's one window
        window = getattr(seen, "sliding_window", None)
    else:
        window = None
    return LayerShape(layer=layer, kind=kind, kv_heads=_int(kv_heads), head_dim=_int(head_dim), window=_int(window))


def layer_shapes(config) -> list[LayerShape]:
    return [layer_shape(config, i) for i in range(layer_count(config))]


def _int(value) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def kv_bytes_per_token(config, layers: list[int] | None = None) -> int:
    """Bytes of bf16 K/V one token takes in the given layers (default: all), each layer at its own KV heads and
    head size (MLA: its latent + rope, one vector per token; dots3's layers each have their own rank)."""
    total = 0
    for i in range(layer_count(config)) if layers is None else layers:
        seen = layer_config(config, i)
        rank = getattr(seen, "kv_lora_rank", None)
        if rank:
            total += (int(rank) + int(getattr(seen, "qk_rope_head_dim", 0) or 0)) * 2
        else:
            shape = layer_shape(config, i)
            total += 2 * (shape.kv_heads or 0) * (shape.head_dim or 0) * 2  # K and V, 2 bytes each (bf16)
    return total


def import_modelling(config) -> None:
    """Import the family's modelling module: some families' cache layer types register with transformers only
    then (DeepSeek-V4's compressed-sparse layers), so `DynamicCache(config=...)` needs it first."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    for model_type in {getattr(config, "model_type", None), getattr(decoder_config(config), "model_type", None)}:
        if not model_type:
            continue
        module = model_type_to_module_name(model_type)
        try:
            importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        except ImportError:  # a family without its own modelling module (shares another's), or one that fails
            pass


def model_cache(config):
    """transformers' own cache for `config` (`DynamicCache(config=...)`), its family's modelling module imported
    first (some register their cache layer types only then)."""
    from transformers import DynamicCache

    import_modelling(config)
    return DynamicCache(config=config)


def transformers_class(name: str, model_type: str | None = None):
    """transformers' class `name` (exported, or from `model_type`'s modelling module), or None."""
    import importlib

    import transformers

    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        pass
    if model_type is None:
        return None
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    try:
        return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name, None)
    except ImportError:
        return None
