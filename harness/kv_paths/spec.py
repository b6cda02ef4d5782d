"""KV-cache path specs: `format[:option...]`, e.g. `bf16`, `fp8_e4m3:per_head:calibrated`, `fp8_e5m2:per_token`.

Every combination of format and scale source is valid (failure class 5: never refuse a valid one).
Only genuine contradictions are refused, with the reason: a dimension set twice, or per-token scales
(computed from each token as it is written) combined with a stored scale source.
"""

from __future__ import annotations

from dataclasses import dataclass

# `harness run` without --paths: healthy paths only, so a default run exits 0 on a sound install. The known-bad
# fp8_e4m3:warmup (scales from one dummy pass) is the README's demonstration of a failing path.
DEFAULT_PATHS = "bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated,fp8_e5m2"

FORMATS = {"bf16": "bf16", "fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
DIMENSIONS = {
    "granularity": ("per_tensor", "per_head", "per_token"),
    "scale_source": ("default", "calibrated", "checkpoint", "warmup"),
    "cast": ("sat", "nosat"),
    "prefill": ("quantized_prefill", "raw_prefill"),
}
SCALE_SOURCE_HELP = {
    "default": "scale 1.0, as vLLM and SGLang use when none is given",
    "calibrated": "amax / fp8 max over the calibration prompts",
    "checkpoint": "k_scale / v_scale tensors stored beside the weights",
    "warmup": "amax from one dummy warm-up pass (recurrent state uninitialised), frozen: failure class 2",
    "dynamic": "per token, from each token as it is written",
}


class PathSpecError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class KVPath:
    name: str
    fmt: str = "bf16"  # bf16 | e4m3 | e5m2
    granularity: str = "per_tensor"
    scale_source: str = "default"
    saturate: bool = True
    # False: the chunk being prefilled attends to its own unquantised K/V (engines that run prefill
    # attention before the cache write); earlier tokens are always read back quantised.
    quantize_current_chunk: bool = True

    @property
    def is_fp8(self) -> bool:
        return self.fmt != "bf16"

    @property
    def canonical(self) -> str:
        if not self.is_fp8:
            return "bf16" if self.scale_source == "default" else f"bf16:{self.scale_source}"
        parts = [f"fp8_{self.fmt}", self.granularity]
        if self.granularity != "per_token":  # per-token scales are always dynamic
            parts.append(self.scale_source)
        parts.append("sat" if self.saturate else "nosat")
        if not self.quantize_current_chunk:
            parts.append("raw_prefill")
        return ":".join(parts)

    def describe(self) -> str:
        if not self.is_fp8:
            note = "" if self.scale_source == "default" else f"; {self.scale_source} scales present and ignored"
            return f"bf16 cache (no quantisation{note})"
        return (f"fp8 {self.fmt} cache, {self.granularity} scales from {self.scale_source} "
                f"({SCALE_SOURCE_HELP[self.scale_source]}), "
                f"{'saturating' if self.saturate else 'non-saturating'} cast")


def parse_path(spec: str) -> KVPath:
    text = spec.strip()
    if not text:
        raise PathSpecError("empty KV path spec; expected e.g. 'bf16' or 'fp8_e4m3:per_head:calibrated'")
    head, *options = [part.strip() for part in text.split(":")]
    if head not in FORMATS:
        raise PathSpecError(f"KV path {spec!r}: unknown cache format {head!r}; expected one of {', '.join(FORMATS)}")
    chosen: dict[str, str] = {}
    for option in options:
        dimension = next((d for d, values in DIMENSIONS.items() if option in values), None)
        if dimension is None:
            valid = "; ".join(f"{d}: {', '.join(v)}" for d, v in DIMENSIONS.items())
            raise PathSpecError(f"KV path {spec!r}: unknown option {option!r}; valid options are {valid}")
        if dimension in chosen:
            raise PathSpecError(f"KV path {spec!r} sets {dimension} twice ({chosen[dimension]!r} and {option!r})")
        chosen[dimension] = option
    granularity = chosen.get("granularity", "per_tensor")
    source = chosen.get("scale_source", "default")
    if granularity == "per_token" and "scale_source" in chosen:
        raise PathSpecError(
            f"KV path {spec!r}: per_token scales are computed from each token as it is written, so they "
            f"cannot also come from {source!r}; use per_tensor or per_head for {source!r} scales")
    return KVPath(
        name=text,
        fmt=FORMATS[head],
        granularity=granularity,
        scale_source="dynamic" if granularity == "per_token" and FORMATS[head] != "bf16" else source,
        saturate=chosen.get("cast", "sat") == "sat",
        quantize_current_chunk=chosen.get("prefill", "quantized_prefill") == "quantized_prefill",
    )


def parse_paths(specs: str | list[str]) -> list[KVPath]:
    """Comma-separated (or listed) specs; names must be unique."""
    items = specs.split(",") if isinstance(specs, str) else [s for item in specs for s in item.split(",")]
    paths = [parse_path(item) for item in items if item.strip()]
    if not paths:
        raise PathSpecError("no KV paths given; expected e.g. --paths bf16,fp8_e4m3")
    names = [p.name for p in paths]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise PathSpecError(f"KV path listed twice: {', '.join(duplicates)}")
    return paths
