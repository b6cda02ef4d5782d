"""KV-cache path specs: `format[:option...]`, e.g. `bf16`, `fp8_e4m3:per_head:calibrated`, `fp8_e5m2:per_token`,
`fp8_e4m3:kernel=dequant` or `fp8_e4m3:kernel=mypkg.attn:decode` (decode through a plug-in kernel).

Beside the cache, a path may quantise the attention computation itself, as engines do with a `q_scale`
and a `prob_scale`: `fp8_q` (the query in FP8 e4m3) and `fp8_p` (the softmax probabilities in FP8 e4m3),
with scales from the path's scale source (default 1.0; calibrated amax / 448; checkpoint `q_scale` /
`prob_scale` tensors; warmup). A per-layer precision map keeps chosen attention layers in BF16:
`layers=FILE` (a map written by `harness sensitivity`) or `keep_bf16=3+7` (layer indices).

Every combination of format and scale source is valid (failure class 5: never refuse a valid one).
Only genuine contradictions are refused, with the reason: a dimension set twice, per-token scales
(computed from each token as it is written) combined with a stored scale source, or the
`k_scale_on_scores` fault option (failure class 3 as a preset) on anything but a BF16 cache with scales.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.files import UnreadableFile, read_bounded
from harness.kv_paths.faults import FAULTS

# `harness run` without --paths: healthy paths only, so a default run exits 0 on a sound install. The known-bad
# fp8_e4m3:warmup (scales from one dummy pass) is the README's demonstration of a failing path.
DEFAULT_PATHS = "bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated,fp8_e5m2"

FORMATS = {"bf16": "bf16", "fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2", "fp32": "fp32"}
# `fp32`: not a cache format but the reference itself in float32 (weights, activations, cache), replayed as a path:
# its divergence from the BF16 reference is the reference's own precision noise, a yardstick measured in the same
# run (docs/VERDICTS.md). It takes no options.
NOISE_FORMAT = "fp32"
DIMENSIONS = {
    "granularity": ("per_tensor", "per_head", "per_token"),
    "scale_source": ("default", "calibrated", "checkpoint", "warmup"),
    "cast": ("sat", "nosat"),
    "prefill": ("quantized_prefill", "raw_prefill"),
    # A fault preset, not a choice: a BF16 cache whose attention scores are multiplied by k_scale, as the
    # SGLang MLA backend did with a checkpoint's scales (failure class 3). Correct BF16 paths ignore scales.
    "scores": ("k_scale_on_scores",),
    "query": ("bf16_q", "fp8_q"),
    "probs": ("bf16_p", "fp8_p"),
    # Fault injectors, not choices: attention arithmetic broken on purpose, small enough to stay below token-level
    # noise on short text (harness/kv_paths/faults.py); the zoo's presets, caught by the implementation check.
    "fault": tuple(f"fault={name}" for name in FAULTS),
}
KEYED_OPTIONS = ("layers", "keep_bf16")  # key=value options: a per-layer precision map
LAYER_MAP_BYTES = 16 << 20  # a sensitivity.json of a 1,000-layer model's ranking is well under 1 MiB
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
    k_scale_on_scores: bool = False  # failure class 3 reproduced: bf16 cache, scores times k_scale
    # Decode-kernel plug-in (`kernel=NAME`): "" is our Triton kernel on CUDA (harness/kv_paths/decode_kernels.py)
    kernel: str = ""
    fp8_q: bool = False  # the query quantised to e4m3 with a q_scale before QK^T
    fp8_prob: bool = False  # the softmax probabilities quantised to e4m3 with a prob_scale before PV
    bf16_layers: tuple[int, ...] = ()  # attention layers left unquantised (a per-layer precision map)
    fault: str = ""  # an attention-arithmetic fault injector (`fault=NAME`, harness/kv_paths/faults.py); "" none

    @property
    def quantizes_attention(self) -> bool:
        return self.fp8_q or self.fp8_prob

    @property
    def is_fp8(self) -> bool:
        return self.fmt in ("e4m3", "e5m2")

    @property
    def is_reference_noise(self) -> bool:
        """The float32 reference (`fp32`): measures the BF16 reference's own precision noise."""
        return self.fmt == NOISE_FORMAT

    @property
    def canonical(self) -> str:
        return self._canonical_kv() + "".join(self._extra_options())

    def _extra_options(self) -> list[str]:
        extra = [":fp8_q"] if self.fp8_q else []
        extra += [":fp8_p"] if self.fp8_prob else []
        if self.bf16_layers:
            extra.append(":keep_bf16=" + "+".join(str(i) for i in self.bf16_layers))
        if self.fault:
            extra.append(f":fault={self.fault}")
        return extra

    def _canonical_kv(self) -> str:
        if self.is_reference_noise:
            return NOISE_FORMAT
        if not self.is_fp8:
            base = "bf16" if self.scale_source == "default" else f"bf16:{self.scale_source}"
            return base + (":k_scale_on_scores" if self.k_scale_on_scores else "")
        parts = [f"fp8_{self.fmt}", self.granularity]
        if self.granularity != "per_token":  # per-token scales are always dynamic
            parts.append(self.scale_source)
        parts.append("sat" if self.saturate else "nosat")
        if not self.quantize_current_chunk:
            parts.append("raw_prefill")
        if self.kernel:
            parts.append(f"kernel={self.kernel}")
        return ":".join(parts)

    def describe(self) -> str:
        extra = []
        if self.quantizes_attention:
            parts = [n for n, on in (("query (q_scale)", self.fp8_q), ("probabilities (prob_scale)", self.fp8_prob)) if on]
            extra.append(f"fp8 e4m3 attention {' and '.join(parts)}, scales from {self.scale_source}")
        if self.bf16_layers:
            extra.append(f"attention layers {', '.join(map(str, self.bf16_layers))} kept in bf16")
        if self.fault:
            extra.append(f"fault injector: {FAULTS[self.fault]}")
        return "; ".join([self._describe_kv(), *extra])

    def _describe_kv(self) -> str:
        if self.is_reference_noise:
            return ("the reference in float32 (weights, activations and cache): the BF16 reference's own precision "
                    "noise, a yardstick")
        if self.k_scale_on_scores:
            return (f"bf16 cache with {self.scale_source} k_scale multiplied into the attention scores "
                    f"(fault preset: failure class 3)")
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
    if FORMATS[head] == NOISE_FORMAT and options:
        raise PathSpecError(f"KV path {spec!r}: fp32 is the reference in float32 (its precision noise) and takes no "
                            f"options")
    options, kernel = _kernel_option(spec, options)
    if kernel and (FORMATS[head] == "bf16" or "per_token" in options):
        raise PathSpecError(f"KV path {spec!r}: kernel={kernel} needs an fp8 cache with per_tensor or per_head "
                            f"scales (the decode-kernel contract, docs/CONTRACTS.md)")
    chosen: dict[str, str] = {}
    bf16_layers: tuple[int, ...] = ()
    for option in options:
        if option.startswith("fault=") and option not in DIMENSIONS["fault"]:
            raise PathSpecError(f"KV path {spec!r}: unknown fault {option.removeprefix('fault=')!r}; fault "
                                f"injectors are {', '.join(FAULTS)} (harness/kv_paths/faults.py)")
        if "=" in option and not option.startswith("fault="):
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
    if "scores" in chosen:
        _check_k_scale_on_scores(spec, FORMATS[head], source)
    fault = chosen.get("fault", "").removeprefix("fault=")
    if fault:
        from harness.kv_paths.faults import check

        problem = check(text, fault, FORMATS[head], granularity, chosen.get("probs") == "fp8_p")
        if problem:
            raise PathSpecError(f"KV path {spec!r}: {problem}")
    return KVPath(
        name=text,
        fmt=FORMATS[head],
        granularity=granularity,
        scale_source="dynamic" if granularity == "per_token" and FORMATS[head] != "bf16" else source,
        saturate=chosen.get("cast", "sat") == "sat",
        quantize_current_chunk=chosen.get("prefill", "quantized_prefill") == "quantized_prefill",
        k_scale_on_scores="scores" in chosen,
        kernel=kernel,
        fp8_q=chosen.get("query") == "fp8_q",
        fp8_prob=chosen.get("probs") == "fp8_p",
        bf16_layers=bf16_layers,
        fault=fault,
    )


def _check_k_scale_on_scores(spec: str, fmt: str, source: str) -> None:
    if fmt != "bf16":
        raise PathSpecError(
            f"KV path {spec!r}: k_scale_on_scores reproduces failure class 3 (a BF16 cache whose attention "
            f"scores are multiplied by k_scale) and applies only to a bf16 cache; an FP8 cache already applies "
            f"k_scale where it belongs, when it dequantises. Use e.g. 'bf16:calibrated:k_scale_on_scores'")
    if source == "default":
        raise PathSpecError(
            f"KV path {spec!r}: k_scale_on_scores needs scales to misapply, and the default scale 1.0 would "
            f"change nothing; add a scale source: 'calibrated' or 'checkpoint'")


def _kernel_option(spec: str, options: list[str]) -> tuple[list[str], str]:
    """Split off `kernel=NAME` (NAME may itself hold one ':', as in `kernel=package.module:function`)."""
    from harness.kv_paths.decode_kernels import BUILTIN, KernelPluginError, check_name

    rest, kernel = [], ""
    i = 0
    while i < len(options):
        option = options[i]
        i += 1
        if not option.startswith("kernel="):
            rest.append(option)
            continue
        if kernel:
            raise PathSpecError(f"KV path {spec!r} sets kernel twice")
        kernel = option.removeprefix("kernel=")
        if kernel not in BUILTIN and i < len(options) and options[i].isidentifier() and not _is_option(options[i]):
            kernel, i = f"{kernel}:{options[i]}", i + 1
        try:
            check_name(kernel)
        except KernelPluginError as e:
            raise PathSpecError(f"KV path {spec!r}: {e}") from e
    return rest, kernel


def _is_option(word: str) -> bool:
    return any(word in values for values in DIMENSIONS.values())


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
        body = json.loads(read_bounded(path, LAYER_MAP_BYTES, "layer map"))
        layers = [int(i) for i in body["bf16_layers"]]
    except FileNotFoundError:
        raise PathSpecError(f"KV path {spec!r}: layer map {file} does not exist") from None
    except UnreadableFile as error:  # a FIFO waits for a writer, /dev/zero never ends: neither is opened
        raise PathSpecError(f"KV path {spec!r}: layer map {error}") from None
    except (OSError, UnicodeDecodeError) as error:  # a directory, a device, unreadable: found by fuzzing
        raise PathSpecError(f"KV path {spec!r}: cannot read layer map {file} ({error})") from None
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
