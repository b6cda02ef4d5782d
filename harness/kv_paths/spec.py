"""KV-cache path specs: `format[:option...]`, e.g. `bf16`, `fp8_e4m3:per_head:calibrated`, `fp8_e5m2:per_token`.

Beside the cache, a path may quantise the attention computation itself, as engines do with a `q_scale`
and a `prob_scale`: `fp8_q` (the query in FP8 e4m3) and `fp8_p` (the softmax probabilities in FP8 e4m3),
with scales from the path's scale source (default 1.0; calibrated amax / 448; checkpoint `q_scale` /
`prob_scale` tensors; warmup). A per-layer precision map keeps chosen attention layers in BF16:
`layers=FILE` (a map written by `harness sensitivity`) or `keep_bf16=3+7` (layer indices).

Every combination of format and scale source is valid (failure class 5: never refuse a valid one).
Only genuine contradictions are refused, with the reason: a dimension set twice, or per-token scales
(computed from each token as it is written) combined with a stored scale source.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = {"bf16": "bf16", "fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
DIMENSIONS = {
    "granularity": ("per_tensor", "per_head", "per_token"),
    "scale_source": ("default", "calibrated", "checkpoint", "warmup"),
    "cast": ("sat", "nosat"),
    "prefill": ("quantized_prefill", "raw_prefill"),
    "query": ("bf16_q", "fp8_q"),
    "probs": ("bf16_p", "fp8_p"),
}
KEYED_OPTIONS = ("layers", "keep_bf16")  # key=value options: a per-layer precision map
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
    fp8_q: bool = False  # the query quantised to e4m3 with a q_scale before QK^T
    fp8_prob: bool = False  # the softmax probabilities quantised to e4m3 with a prob_scale before PV
    bf16_layers: tuple[int, ...] = ()  # attention layers left unquantised (a per-layer precision map)

    @property
    def quantizes_attention(self) -> bool:
        return self.fp8_q or self.fp8_prob

    @property
    def is_fp8(self) -> bool:
        return self.fmt != "bf16"

    @property
    def canonical(self) -> str:
        return self._canonical_kv() + "".join(self._extra_options())

    def _extra_options(self) -> list[str]:
        extra = [":fp8_q"] if self.fp8_q else []
        extra += [":fp8_p"] if self.fp8_prob else []
        if self.bf16_layers:
            extra.append(":keep_bf16=" + "+".join(str(i) for i in self.bf16_layers))
        return extra

    def _canonical_kv(self) -> str:
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
        extra = []
        if self.quantizes_attention:
            parts = [n for n, on in (("query (q_scale)", self.fp8_q), ("probabilities (prob_scale)", self.fp8_prob)) if on]
            extra.append(f"fp8 e4m3 attention {' and '.join(parts)}, scales from {self.scale_source}")
        if self.bf16_layers:
            extra.append(f"attention layers {', '.join(map(str, self.bf16_layers))} kept in bf16")
        return "; ".join([self._describe_kv(), *extra])

    def _describe_kv(self) -> str:
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
    bf16_layers: tuple[int, ...] = ()
    for option in options:
        if "=" in option:
            if bf16_layers:
                raise PathSpecError(f"KV path {spec!r} sets the per-layer precision map twice")
            bf16_layers = _keyed_option(spec, option)
            continue
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
        fp8_q=chosen.get("query") == "fp8_q",
        fp8_prob=chosen.get("probs") == "fp8_p",
        bf16_layers=bf16_layers,
    )


def _keyed_option(spec: str, option: str) -> tuple[int, ...]:
    """`keep_bf16=3+7` or `layers=FILE` (JSON with "bf16_layers": [..], as `harness sensitivity` writes)."""
    key, _, value = option.partition("=")
    if key not in KEYED_OPTIONS:
        raise PathSpecError(f"KV path {spec!r}: unknown option {key!r}; key=value options are {', '.join(KEYED_OPTIONS)}")
    if key == "keep_bf16":
        try:
            layers = [int(part) for part in value.split("+") if part.strip()]
        except ValueError:
            raise PathSpecError(f"KV path {spec!r}: keep_bf16 takes layer indices joined by '+', e.g. keep_bf16=3+7; "
                                f"got {value!r}") from None
    else:
        layers = read_layer_map(spec, value)
    if any(i < 0 for i in layers):
        raise PathSpecError(f"KV path {spec!r}: negative layer index in {option!r}")
    return tuple(sorted(set(layers)))


def read_layer_map(spec: str, file: str) -> list[int]:
    import json
    from pathlib import Path

    path = Path(file)
    try:
        body = json.loads(path.read_text())
        layers = [int(i) for i in body["bf16_layers"]]
    except FileNotFoundError:
        raise PathSpecError(f"KV path {spec!r}: layer map {file} does not exist") from None
    except (ValueError, KeyError, TypeError) as error:
        raise PathSpecError(f"KV path {spec!r}: layer map {file} is not a precision map "
                            f"(JSON with \"bf16_layers\": [layer, ...]): {error}") from None
    return layers


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
