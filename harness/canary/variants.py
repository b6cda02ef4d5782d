"""Stress variants of the canaries: the same BF16 model, reparametrised so its KV cache has a harder range.

A variant is a folder holding `variant.json` (the base canary and a deterministic transform) and a
model card (`README.md`); its weights are derived from the base's when it is loaded, so no weights ship.
Both transforms move a power of two (`alpha`) between two weights whose product the model uses, so the
BF16 model computes bit for bit the same thing (scaling by 2^k is exact in bf16 short of overflow) while
the tensor the cache stores is `alpha` times larger in some channels:

- `mla_latent_scale` (DeepSeek-V3 MLA): `kv_a_layernorm.weight * alpha`, `kv_b_proj.weight / alpha`, every
  layer. The cached latent `kv_c_normed` is `alpha` times larger; keys and values after the up-projection
  are unchanged. Failure class 1: an engine-default scale 1.0 no longer fits the latent.
- `rope_key_outlier` (Llama GQA): in every layer, both channels of one RoPE pair (`pair`, `pair + d/2`) of
  one KV head in `k_proj` times `alpha`, the same channels of every query head of its group in `q_proj`
  divided by `alpha`: q.k is unchanged, K gets one outlier channel pair as real LLMs' keys do.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.model_layers import field, layer_shape

VARIANT_FILE = "variant.json"
TRANSFORMS = ("mla_latent_scale", "rope_key_outlier")


class VariantError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Variant:
    base: Path  # the canary folder whose weights are transformed
    transform: str
    alpha: float
    kv_head: int = 0  # rope_key_outlier: which KV head gets the outlier pair
    pair: int = -1  # rope_key_outlier: RoPE pair index in [0, head_dim / 2); -1 = the last (lowest frequency)
    source: str = ""  # the variant.json this came from

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise VariantError(f"{self.source}: transform {self.transform!r}; expected one of {', '.join(TRANSFORMS)}")
        exponent = math.log2(self.alpha) if self.alpha > 0 else float("nan")
        if not (math.isfinite(exponent) and exponent == round(exponent) and self.alpha != 1):
            raise VariantError(f"{self.source}: alpha {self.alpha!r} must be a power of two other than 1 "
                               f"(a power of two keeps the BF16 model bit-identical)")
        if not (self.base / "config.json").is_file():
            raise VariantError(f"{self.source}: base {str(self.base)!r} has no config.json")

    def describe(self) -> dict:
        return {"base": str(self.base), "transform": self.transform, "alpha": self.alpha,
                **({"kv_head": self.kv_head, "pair": self.pair} if self.transform == "rope_key_outlier" else {})}


def read_variant(directory: Path) -> Variant | None:
    """The variant a folder describes, or None when it holds plain weights."""
    file = Path(directory) / VARIANT_FILE
    if not file.is_file():
        return None
    try:
        spec = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise VariantError(f"{file}: not valid JSON ({error})") from None
    unknown = set(spec) - {"base", "transform", "alpha", "kv_head", "pair", "note"}
    if unknown or "base" not in spec or "transform" not in spec or "alpha" not in spec:
        raise VariantError(f"{file}: needs base, transform, alpha (optional kv_head, pair, note); "
                           f"unknown keys: {sorted(unknown)}")
    return Variant(base=(file.parent / spec["base"]).resolve(), transform=spec["transform"],
                   alpha=float(spec["alpha"]), kv_head=int(spec.get("kv_head", 0)), pair=int(spec.get("pair", -1)),
                   source=str(file))


@torch.no_grad()
def apply_variant(model: torch.nn.Module, variant: Variant) -> None:
    """Reparametrise `model` (loaded from `variant.base`) in place."""
    if variant.transform == "mla_latent_scale":
        _mla_latent_scale(model, variant)
    else:
        _rope_key_outlier(model, variant)


def _attention_modules(model: torch.nn.Module, needed: str, variant: Variant) -> list[torch.nn.Module]:
    found = [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, needed)]
    if not found:
        raise VariantError(f"{variant.source}: {variant.transform} needs attention modules with {needed!r}; "
                           f"{type(model).__name__} has none")
    return found


def _mla_latent_scale(model: torch.nn.Module, variant: Variant) -> None:
    for attn in _attention_modules(model, "kv_a_layernorm", variant):
        attn.kv_a_layernorm.weight.mul_(variant.alpha)
        attn.kv_b_proj.weight.div_(variant.alpha)


def _rope_key_outlier(model: torch.nn.Module, variant: Variant) -> None:
    config = model.config
    shape = layer_shape(config, 0)  # the canaries' layers are all alike
    head_dim, kv_heads, q_heads = shape.head_dim, shape.kv_heads, field(config, "num_attention_heads")
    half = head_dim // 2
    pair = variant.pair % half
    if not 0 <= variant.kv_head < kv_heads:
        raise VariantError(f"{variant.source}: kv_head {variant.kv_head} out of range (model has {kv_heads})")
    channels = [pair, pair + half]  # rotate_half RoPE rotates channel i with i + d/2
    group = q_heads // kv_heads
    for attn in _attention_modules(model, "k_proj", variant):
        if hasattr(attn, "k_norm"):
            raise VariantError(f"{variant.source}: rope_key_outlier is not function-preserving with a k_norm")
        for c in channels:
            attn.k_proj.weight[variant.kv_head * head_dim + c].mul_(variant.alpha)
            for q_head in range(variant.kv_head * group, (variant.kv_head + 1) * group):
                attn.q_proj.weight[q_head * head_dim + c].div_(variant.alpha)
