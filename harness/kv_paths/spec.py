"""KV-cache path specs: `format[:option...]`, e.g. `bf16`, `fp8_e4m3:per_head:calibrated`, `fp8_e5m2:per_token`,
`fp8_e4m3:kernel=dequant` or `fp8_e4m3:kernel=mypkg.attn:decode` (decode through a plug-in kernel).
A format is any registered `KVFormat` spelling (harness/kv_paths/formats.py: `nvfp4`, `mxfp8`, `mxfp4`,
`int8_per_token_head`, `fp8_ds_mla`, ...); K and V may differ: `k=fp8_e4m3/v=nvfp4` (`v=bf16`: V unquantised).
Scale options (granularity, scale source) apply to a format's static scale; formats whose scales are all computed
at write (MX, per token-head) take none. An engine's own `--kv-cache-dtype` value is a head too: `vllm:nvfp4`,
`sglang:fp4_mx_block16` (docs/FORMATS.md maps each, or says why it is refused).

The prefill may attend in another format than the cache stores (SGLang's `--prefill-kv-cache-dtype`; a
disaggregated prefill worker whose cache format is not the decode worker's): `nvfp4:prefill=fp8_e4m3` attends each
prefill chunk to its own K/V written in fp8_e4m3, while the cache (earlier chunks, every decode step) holds nvfp4;
`raw_prefill` is `prefill=bf16`. `hadamard` rotates K (and Q, at attention) over head_dim before quantising
(harness/kv_paths/rotation.py). `keep_bf16=sliding_window` keeps every sliding-window attention layer in BF16
(vLLM's `--kv-cache-dtype-skip-layers sliding_window`), resolved against the model's layers when it loads.

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
from harness.kv_paths import formats as kv_formats
from harness.kv_paths.faults import FAULTS

# `harness run` without --paths: healthy paths only, so a default run exits 0 on a sound install. The known-bad
# fp8_e4m3:warmup (scales from one dummy pass) is the README's demonstration of a failing path.
DEFAULT_PATHS = "bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated,fp8_e5m2"

FORMATS = {"bf16": "bf16", "fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2", "fp32": "fp32",
           **{spelling: kv_formats.format_of_spelling(spelling).name for spelling in kv_formats.spellings()}}
UNQUANTISED = ("bf16", "fp32")
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
    # Not a choice either: the cache format written again outside the engine (torch's own cast in the reference's
    # cache write, its own calibration pass; harness/kv_paths/emulated.py): the yardstick's twin, which a fault in
    # the engine cannot move (docs/VERDICTS.md). Format, granularity, default/calibrated scales and cast only.
    "implementation": ("emulated",),
    # The prompt prefilled in chunks of CONTROL_PREFILL_CHUNK tokens, as engines chunk long prefills: with `bf16`,
    # the run's control arm (CONTROL_ARM), BF16 against BF16 under a perturbation the engine really has.
    "chunking": ("chunked_prefill",),
    # K (and Q) rotated over head_dim before K is quantised (harness/kv_paths/rotation.py)
    "rotation": ("hadamard",),
}
CONTROL_PREFILL_CHUNK = 32  # tokens per prefill chunk (vLLM chunks at max_num_batched_tokens, 2048+; this small so
# the canaries' short prompts are chunked too)
# The control arm every in-process run adds (harness/runs/gate.py): the reference's numerics, prefilled in chunks
# and, on CUDA, decoded in its own batch composition; its divergence from the reference is the engine's own noise.
CONTROL_ARM = "bf16:chunked_prefill"
KEYED_OPTIONS = ("layers", "keep_bf16", "prefill")  # key=value options: a per-layer precision map, a prefill format
SLIDING_WINDOW = "sliding_window"  # keep_bf16's word for every sliding-window attention layer (vLLM's)
LAYER_MAP_BYTES = 16 << 20  # a sensitivity.json of a 1,000-layer model's ranking is well under 1 MiB
SCALE_SOURCE_HELP = {
    "default": "scale 1.0, as vLLM and SGLang use when none is given",
    "calibrated": "amax / fp8 max over the calibration prompts",
    "checkpoint": "k_scale / v_scale tensors stored beside the weights",
    "warmup": "amax from one dummy warm-up pass (recurrent state uninitialised), frozen: failure class 2",
    "dynamic": "computed at write from the values written (per token, per token-head or per block)",
}


class PathSpecError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class KVPath:
    name: str
    fmt: str = "bf16"  # bf16 | fp32 | a registered KVFormat's name (e4m3, e5m2, nvfp4, ...): K's format, and V's
    v_fmt: str = ""  # V's format where it differs from K's (`k=A/v=B`); "" the same
    granularity: str = "per_tensor"
    scale_source: str = "default"
    saturate: bool = True
    # The format a prefill chunk (more than one token) attends to its own K/V in: "" the cache's (written, then
    # read); "bf16" raw (`raw_prefill`: engines that run prefill attention before the cache write); a KVFormat name
    # (`prefill=FORMAT`). Earlier tokens, and every decode step, always read the cache's format.
    prefill_fmt: str = ""
    k_scale_on_scores: bool = False  # failure class 3 reproduced: bf16 cache, scores times k_scale
    # Decode-kernel plug-in (`kernel=NAME`): "" is our Triton kernel on CUDA (harness/kv_paths/decode_kernels.py)
    kernel: str = ""
    fp8_q: bool = False  # the query quantised to e4m3 with a q_scale before QK^T
    fp8_prob: bool = False  # the softmax probabilities quantised to e4m3 with a prob_scale before PV
    bf16_layers: tuple[int, ...] = ()  # attention layers left unquantised (a per-layer precision map)
    bf16_sliding: bool = False  # every sliding-window attention layer left unquantised too (`keep_bf16=sliding_window`)
    hadamard: bool = False  # K (and Q at attention) rotated over head_dim before quantising (kv_paths/rotation.py)
    fault: str = ""  # a fault injector (`fault=NAME`: attention arithmetic, kv_paths/faults.py; a cache format's,
    # kv_paths/format_faults.py); "" none
    emulated: bool = False  # the format emulated outside the engine: the yardstick's twin (kv_paths/emulated.py)
    prefill_chunk: int = 0  # tokens per prefill chunk (`chunked_prefill`); 0: the engine's own chunking

    @property
    def quantizes_attention(self) -> bool:
        return self.fp8_q or self.fp8_prob

    @property
    def quantize_current_chunk(self) -> bool:
        """A prefill chunk attends to its own K/V as the cache reads them back (no prefill format of its own)."""
        return not self.prefill_fmt

    @property
    def prefill_format(self) -> kv_formats.KVFormat | None:
        """The format a prefill chunk attends to its own K/V in, where it is one (None: the cache's, or raw)."""
        return kv_formats.get_format(self.prefill_fmt) if self.prefill_fmt not in ("", "bf16") else None

    @property
    def keeps_layers_bf16(self) -> bool:
        """Some attention layers stay unquantised (indices, or the model's sliding-window layers)."""
        return bool(self.bf16_layers) or self.bf16_sliding

    @property
    def is_quantized(self) -> bool:
        """The cache stores a registered format (any), not bf16 (and this is not the float32 reference)."""
        return self.fmt not in UNQUANTISED

    @property
    def k_format(self) -> kv_formats.KVFormat | None:
        return kv_formats.get_format(self.fmt) if self.is_quantized else None

    @property
    def v_format(self) -> kv_formats.KVFormat | None:
        return kv_formats.get_format(self.v_fmt or self.fmt) if self.is_quantized else None

    @property
    def is_fp8(self) -> bool:
        """K and V both FP8 e4m3 / e5m2 under static (or per-token) scales alone: the formats our kernels, the
        fused write and the C write know (harness/kv_paths/capabilities.py says which serve what)."""
        return self.is_quantized and self.k_format.is_legacy_fp8 and self.v_format.is_legacy_fp8

    @property
    def has_static_scale(self) -> bool:
        """Some side's format (or the prefill's) takes a static scale from the scale source (per_token FP8 computes
        its own)."""
        prefill = self.prefill_format
        return (self.is_quantized and self.granularity != "per_token"
                and (self.k_format.has_static_scale or self.v_format.has_static_scale
                     or (prefill is not None and prefill.has_static_scale)))

    @property
    def is_reference_noise(self) -> bool:
        """The float32 reference (`fp32`): measures the BF16 reference's own precision noise."""
        return self.fmt == NOISE_FORMAT

    @property
    def canonical(self) -> str:
        return self._canonical_kv() + "".join(self._extra_options())

    @property
    def is_control(self) -> bool:
        """The control arm: a BF16 cache perturbed only in how the engine schedules it (`CONTROL_ARM`)."""
        return self.fmt == "bf16" and bool(self.prefill_chunk) and not self.k_scale_on_scores

    def _extra_options(self) -> list[str]:
        extra = [":chunked_prefill"] if self.prefill_chunk else []
        extra += [":fp8_q"] if self.fp8_q else []
        extra += [":fp8_p"] if self.fp8_prob else []
        if self.keeps_layers_bf16:
            extra.append(":keep_bf16=" + "+".join([*map(str, self.bf16_layers)] + [SLIDING_WINDOW] * self.bf16_sliding))
        if self.fault:
            extra.append(f":fault={self.fault}")
        return extra

    def _canonical_kv(self) -> str:
        if self.is_reference_noise:
            return NOISE_FORMAT
        if not self.is_quantized:
            base = "bf16" if self.scale_source == "default" else f"bf16:{self.scale_source}"
            return base + (":k_scale_on_scores" if self.k_scale_on_scores else "") + "".join(
                f":{option}" for option in self._prefill_and_rotation())
        parts = [self._format_head()]
        if self.has_static_scale or self.granularity == "per_token":
            parts.append(self.granularity)
        if self.has_static_scale:  # per-token and block scales are always dynamic
            parts.append(self.scale_source)
        if not (self.k_format.saturating_only or self.v_format.saturating_only):
            parts.append("sat" if self.saturate else "nosat")
        parts += self._prefill_and_rotation()
        if self.emulated:
            parts.append("emulated")
        if self.kernel:
            parts.append(f"kernel={self.kernel}")
        return ":".join(parts)

    def _prefill_and_rotation(self) -> list[str]:
        parts = []
        if self.prefill_fmt:
            parts.append("raw_prefill" if self.prefill_fmt == "bf16" else f"prefill={self.prefill_format.spec_name}")
        return parts + (["hadamard"] if self.hadamard else [])

    def _format_head(self) -> str:
        """The head that parses back to (fmt, v_fmt): one spelling where V takes what K's format names for it (its
        own format, or its `pairs_with`: fp8_ds_mla), else k=/v= (an unquantised side spelled bf16)."""
        v_fmt = self.v_fmt or self.fmt
        if v_fmt == (self.k_format.pairs_with or self.fmt):
            return self.k_format.spec_name
        return f"k={_side_name(self.k_format)}/v={_side_name(self.v_format)}"

    def describe(self) -> str:
        extra = [f"prompt prefilled in chunks of {self.prefill_chunk} tokens"] if self.prefill_chunk else []
        if self.is_control:
            extra.append("the run's control arm: BF16 against BF16 under a perturbation the engine has")
        if self.quantizes_attention:
            parts = [n for n, on in (("query (q_scale)", self.fp8_q), ("probabilities (prob_scale)", self.fp8_prob)) if on]
            extra.append(f"fp8 e4m3 attention {' and '.join(parts)}, scales from {self.scale_source}")
        if self.keeps_layers_bf16:
            kept = [f"attention layers {', '.join(map(str, self.bf16_layers))}"] * bool(self.bf16_layers) + \
                ["every sliding-window attention layer"] * self.bf16_sliding
            extra.append(f"{' and '.join(kept)} kept in bf16")
        if self.prefill_fmt:
            extra.append("a prefill chunk attends to its own K/V " + (
                "raw (before the cache write)" if self.prefill_fmt == "bf16" else
                f"in {self.prefill_format.spec_name} ({self.prefill_format.describe()}); decode reads the cache's"))
        if self.hadamard:
            extra.append("K and Q rotated by a normalised Hadamard transform over head_dim before K is quantised")
        if self.fault:
            extra.append(f"fault injector: {FAULTS[self.fault]}")
        return "; ".join([self._describe_kv(), *extra])

    def _describe_kv(self) -> str:
        if self.is_reference_noise:
            return ("the reference in float32 (weights, activations and cache): the BF16 reference's own precision "
                    "noise, a yardstick")
        if self.emulated:
            return (f"fp8 {self.fmt} cache, {self.granularity} scales from {self.scale_source}, written again outside "
                    f"the engine (harness/kv_paths/emulated.py: torch's cast, its own calibration pass): the "
                    f"yardstick's twin, measured, not judged")
        if self.k_scale_on_scores:
            return (f"bf16 cache with {self.scale_source} k_scale multiplied into the attention scores "
                    f"(fault preset: failure class 3)")
        if not self.is_quantized:
            note = "" if self.scale_source == "default" else f"; {self.scale_source} scales present and ignored"
            return f"bf16 cache (no quantisation{note})"
        if not self.is_fp8:
            return self._describe_formats()
        return (f"fp8 {self.fmt} cache, {self.granularity} scales from {self.scale_source} "
                f"({SCALE_SOURCE_HELP[self.scale_source]}), "
                f"{'saturating' if self.saturate else 'non-saturating'} cast")


    def _describe_formats(self) -> str:
        static = (f"; static scales {self.granularity} from {self.scale_source} ({SCALE_SOURCE_HELP[self.scale_source]})"
                  if self.has_static_scale else "")
        if self.k_format is self.v_format or self.v_format.name == self.k_format.pairs_with:
            return f"{self.k_format.spec_name} cache: {self.k_format.describe()}{static}"
        return (f"K {self.k_format.spec_name} ({self.k_format.describe()}), V {self.v_format.spec_name} "
                f"({self.v_format.describe()}){static}")


# Engine `--kv-cache-dtype` values (docs/FORMATS.md): `vllm:nvfp4`, `sglang:mxfp8`. A value maps to our spec head,
# or to a refusal saying what is missing.
ENGINE_KV_DTYPES: dict[str, dict[str, str]] = {
    "vllm": {"auto": "bf16", "float16": "bf16", "bfloat16": "bf16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
             "fp8_e5m2": "fp8_e5m2", "fp8_per_token_head": "fp8_per_token_head",
             "int8_per_token_head": "int8_per_token_head", "nvfp4": "nvfp4", "nvfp4_4over6": "nvfp4_4over6",
             "fp8_ds_mla": "fp8_ds_mla", "nvfp4_ds_mla": "nvfp4_ds_mla"},
    "sglang": {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
               "mxfp8": "mxfp8", "nvfp4": "nvfp4", "fp4_mx_block16": "fp4_mx_block16", "fp4_e2m1": "fp4_mx_block16",
               "int8": "int8_per_token_head_asym"},
}
ENGINE_REFUSALS: dict[str, dict[str, str]] = {
    "vllm": {
        "fp8_inc": "Intel Gaudi's INC-scaled e4m3: its scale rule is not declared here (nearest: fp8_e4m3:calibrated)",
        "int4_per_token_head": "vLLM's int4 is a 16-level codebook with fp16 group scales, not declared here; "
                               "int4_per_token_head is our linear symmetric int4",
        **{name: "TurboQuant's rotation and codebooks are not declared here" for name in (
            "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")},
    },
    "sglang": {},
}


def _engine_head(spec: str, head: str, options: list[str]) -> tuple[str, str, list[str]]:
    """`vllm:VALUE[:option...]` / `sglang:VALUE[:option...]` -> (the engine or "", our head, the other options)."""
    if head not in ENGINE_KV_DTYPES:
        return "", head, options
    if not options:
        raise PathSpecError(f"KV path {spec!r}: {head}: needs the engine's --kv-cache-dtype value, e.g. {head}:nvfp4")
    return head, _engine_value(spec, head, "--kv-cache-dtype", options[0]), options[1:]


def _engine_value(spec: str, engine: str, flag: str, value: str) -> str:
    """An engine's KV dtype value (of --kv-cache-dtype or --prefill-kv-cache-dtype) -> our spelling, or the refusal."""
    if value in ENGINE_REFUSALS[engine]:
        raise PathSpecError(f"KV path {spec!r}: {engine} {flag} {value} is refused: "
                            f"{ENGINE_REFUSALS[engine][value]} (docs/FORMATS.md)")
    if value not in ENGINE_KV_DTYPES[engine]:
        raise PathSpecError(f"KV path {spec!r}: unknown {engine} {flag} {value!r}; known: "
                            f"{', '.join([*ENGINE_KV_DTYPES[engine], *ENGINE_REFUSALS[engine]])}")
    return ENGINE_KV_DTYPES[engine][value]


UNQUANTISED_SIDE = "unquantised"  # the KVFormat of a K or V side kept in the model dtype (`v=bf16`)


def _side_name(kv_format: kv_formats.KVFormat) -> str:
    return "bf16" if kv_format.name == UNQUANTISED_SIDE else kv_format.spec_name


def _formats_of_head(spec: str, head: str) -> tuple[str, str]:
    """(fmt, v_fmt) a spec's head names: a format spelling (V in its `pairs_with` where it names one: fp8_ds_mla), or
    `k=A/v=B` (`bf16` for a side left unquantised); v_fmt "" where V is K's format, bf16 where neither is quantised."""
    if "=" not in head:
        found = kv_formats.format_of_spelling(head)
        if head in ("bf16", NOISE_FORMAT) or found is None:
            if head not in FORMATS:
                known = ", ".join(dict.fromkeys(["bf16", NOISE_FORMAT, *kv_formats.spellings()]))
                raise PathSpecError(f"KV path {spec!r}: unknown cache format {head!r}; expected one of {known}, "
                                    f"or K and V apart as k=FORMAT/v=FORMAT")
            return FORMATS[head], ""
        if found.name == UNQUANTISED_SIDE:
            return "bf16", ""
        return found.name, found.pairs_with
    sides = dict(part.partition("=")[::2] for part in head.split("/"))
    if sorted(sides) != ["k", "v"] or head.count("/") != 1:
        raise PathSpecError(f"KV path {spec!r}: mixed K/V formats are spelled k=FORMAT/v=FORMAT, e.g. "
                            f"k=fp8_e4m3/v=nvfp4 (v=bf16: V unquantised); got {head!r}")
    chosen = {}
    for side, spelling in sides.items():
        found = kv_formats.format_of_spelling(UNQUANTISED_SIDE if spelling == "bf16" else spelling)
        if found is None:
            raise PathSpecError(f"KV path {spec!r}: unknown {side.upper()} format {spelling!r}; expected one of "
                                f"bf16, {', '.join(kv_formats.spellings())}")
        chosen[side] = found.name
    if chosen["k"] == chosen["v"] == UNQUANTISED_SIDE:
        return "bf16", ""
    return chosen["k"], "" if chosen["v"] == chosen["k"] else chosen["v"]


def _prefill_option(spec: str, engine: str, value: str, fmt: str, v_fmt: str) -> str:
    """`prefill=FORMAT` (under an engine head, the engine's own value: `sglang:nvfp4:prefill=fp8_e4m3`) -> the
    path's `prefill_fmt`: "bf16" (raw), "" (the cache's own format: nothing to say), or a KVFormat name."""
    flag = "--prefill-kv-cache-dtype"
    if not value:
        raise PathSpecError(f"KV path {spec!r}: prefill= needs the format a prefill chunk attends in, e.g. "
                            f"prefill=fp8_e4m3 (prefill=bf16: its raw K/V)")
    spelling = _engine_value(spec, engine, flag, value) if engine else value
    if spelling in ("bf16", "unquantised"):
        return "" if fmt == "bf16" else "bf16"
    found = kv_formats.format_of_spelling(spelling)
    if found is None:
        raise PathSpecError(f"KV path {spec!r}: unknown prefill format {value!r} ({flag}); expected bf16 or one of "
                            f"{', '.join(s for s in kv_formats.spellings() if s != 'unquantised')}")
    if found.pairs_with:
        raise PathSpecError(f"KV path {spec!r}: prefill={value}: a prefill format is one format for K and V; "
                            f"{found.spec_name} is a latent layout with its own k_pe format")
    return "" if found.name == fmt and v_fmt in ("", fmt) else found.name


def _check_scale_options(spec: str, fmt: str, v_fmt: str, chosen: dict[str, str], prefill_fmt: str = "") -> None:
    """Scale options a path's formats cannot take: named with the format and the option."""
    if fmt in UNQUANTISED:
        return
    k_format, v_format = kv_formats.get_format(fmt), kv_formats.get_format(v_fmt or fmt)
    prefill = kv_formats.get_format(prefill_fmt) if prefill_fmt not in ("", "bf16") else None
    static = k_format.has_static_scale or v_format.has_static_scale or (prefill is not None and prefill.has_static_scale)
    for dimension in ("granularity", "scale_source"):
        if dimension in chosen and not static:
            raise PathSpecError(
                f"KV path {spec!r}: option {chosen[dimension]!r} sets a static scale, and {k_format.spec_name}"
                f"{'' if k_format is v_format else ' / ' + v_format.spec_name} has none: its scales "
                f"({k_format.granularity}) are computed at write")
    if chosen.get("granularity") == "per_token" and not (k_format.is_legacy_fp8 and v_format.is_legacy_fp8):
        raise PathSpecError(f"KV path {spec!r}: per_token applies to fp8_e4m3 / fp8_e5m2 static scales; for a "
                            f"per token-head format use fp8_per_token_head, int8_per_token_head or int4_per_token_head")
    if "cast" in chosen and (k_format.saturating_only or v_format.saturating_only):
        raise PathSpecError(f"KV path {spec!r}: option {chosen['cast']!r} chooses FP8's overflow cast; "
                            f"{(v_format if v_format.saturating_only else k_format).spec_name} always saturates")


def parse_path(spec: str) -> KVPath:
    text = spec.strip()
    if not text:
        raise PathSpecError("empty KV path spec; expected e.g. 'bf16' or 'fp8_e4m3:per_head:calibrated'")
    head, *options = [part.strip() for part in text.split(":")]
    engine, head, options = _engine_head(spec, head, options)
    fmt, v_fmt = _formats_of_head(spec, head)
    if fmt == NOISE_FORMAT and options:
        raise PathSpecError(f"KV path {spec!r}: fp32 is the reference in float32 (its precision noise) and takes no "
                            f"options")
    options, kernel = _kernel_option(spec, options)
    legacy_fp8 = fmt not in UNQUANTISED and all(kv_formats.get_format(f).is_legacy_fp8 for f in (fmt, v_fmt or fmt))
    if kernel and (not legacy_fp8 or "per_token" in options or "emulated" in options):
        raise PathSpecError(f"KV path {spec!r}: kernel={kernel} needs an fp8 cache with per_tensor or per_head "
                            f"scales (the decode-kernel contract, docs/CONTRACTS.md)")
    if kernel and "hadamard" in options:
        raise PathSpecError(f"KV path {spec!r}: kernel={kernel} decodes the cache against the model's own query "
                            f"(docs/CONTRACTS.md); hadamard stores rotated K, read with a rotated query")
    chosen: dict[str, str] = {}
    bf16_layers: tuple[int, ...] | None = None
    bf16_sliding = False
    prefill_fmt = ""
    for option in options:
        if option.startswith("fault=") and option not in DIMENSIONS["fault"]:
            raise PathSpecError(f"KV path {spec!r}: unknown fault {option.removeprefix('fault=')!r}; fault "
                                f"injectors are {', '.join(FAULTS)} (harness/kv_paths/faults.py)")
        if option.startswith("prefill="):
            if "prefill" in chosen:
                raise PathSpecError(f"KV path {spec!r} sets prefill twice ({chosen['prefill']!r} and {option!r})")
            chosen["prefill"] = option
            prefill_fmt = _prefill_option(spec, engine, option.removeprefix("prefill="), fmt, v_fmt)
            continue
        if "=" in option and not option.startswith("fault="):
            if bf16_layers is not None:
                raise PathSpecError(f"KV path {spec!r} sets the per-layer precision map twice")
            bf16_layers, bf16_sliding = _keyed_option(spec, option)
            continue
        dimension = next((d for d, values in DIMENSIONS.items() if option in values), None)
        if dimension is None:
            valid = "; ".join(f"{d}: {', '.join(v)}" for d, v in DIMENSIONS.items())
            raise PathSpecError(f"KV path {spec!r}: unknown option {option!r}; valid options are {valid}")
        if dimension in chosen:
            raise PathSpecError(f"KV path {spec!r} sets {dimension} twice ({chosen[dimension]!r} and {option!r})")
        chosen[dimension] = option
    bf16_layers = bf16_layers or ()
    if chosen.get("prefill") == "raw_prefill":
        prefill_fmt = "" if fmt == "bf16" else "bf16"
    _check_scale_options(spec, fmt, v_fmt, chosen, prefill_fmt)
    granularity = chosen.get("granularity", "per_tensor")
    source = chosen.get("scale_source", "default")
    if granularity == "per_token" and "scale_source" in chosen:
        raise PathSpecError(
            f"KV path {spec!r}: per_token scales are computed from each token as it is written, so they "
            f"cannot also come from {source!r}; use per_tensor or per_head for {source!r} scales")
    if "scores" in chosen:
        _check_k_scale_on_scores(spec, fmt, source)
    if "implementation" in chosen:
        _check_emulated(spec, fmt, chosen, bf16_layers or bf16_sliding, v_fmt)
    fault = chosen.get("fault", "").removeprefix("fault=")
    if fault:
        from harness.kv_paths.faults import check

        problem = check(text, fault, fmt, granularity, chosen.get("probs") == "fp8_p", v_fmt)
        if problem:
            raise PathSpecError(f"KV path {spec!r}: {problem}")
    dynamic = fmt not in UNQUANTISED and (granularity == "per_token" or not any(
        kv_formats.get_format(f).has_static_scale for f in (fmt, v_fmt or fmt, prefill_fmt) if f not in ("", "bf16")))
    return KVPath(
        name=text,
        fmt=fmt,
        v_fmt=v_fmt,
        granularity=granularity,
        scale_source="dynamic" if dynamic else source,
        saturate=chosen.get("cast", "sat") == "sat",
        prefill_fmt=prefill_fmt,
        k_scale_on_scores="scores" in chosen,
        kernel=kernel,
        fp8_q=chosen.get("query") == "fp8_q",
        fp8_prob=chosen.get("probs") == "fp8_p",
        bf16_layers=bf16_layers,
        bf16_sliding=bf16_sliding,
        hadamard="rotation" in chosen,
        fault=fault,
        emulated="implementation" in chosen,
        prefill_chunk=CONTROL_PREFILL_CHUNK if "chunking" in chosen else 0,
    )


def twin_of(spec: str) -> str | None:
    """The twin of a yardstick spec, canonical (`fp8_e4m3:per_tensor:calibrated:sat:emulated`): its cache
    numerics written outside the engine; None where the twin cannot compute them alone (no FP8 cache, scales from
    a checkpoint or a warm-up pass, FP8 attention, a kernel or prefill option, a per-layer map, a fault)."""
    stick = parse_path(spec)
    if not stick.is_fp8 or stick.emulated or stick.v_fmt or stick.scale_source not in ("default", "calibrated", "dynamic"):
        return None
    if (stick.kernel or stick.quantizes_attention or stick.keeps_layers_bf16 or stick.fault or stick.hadamard
            or not stick.quantize_current_chunk):
        return None
    try:  # any other option the twin does not take (chunked prefill, ...): no twin, as above
        return parse_path(stick.canonical + ":emulated").canonical
    except PathSpecError:
        return None


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


EMULATED_DIMENSIONS = ("granularity", "cast", "implementation")  # with the default or calibrated scale source


def _check_emulated(spec: str, fmt: str, chosen: dict[str, str], bf16_layers, v_fmt: str) -> None:
    if fmt not in ("e4m3", "e5m2") or (v_fmt and v_fmt != fmt):
        raise PathSpecError(f"KV path {spec!r}: emulated is an fp8 cache written outside the engine (the "
                            f"yardstick's twin); use e.g. 'fp8_e4m3:calibrated:emulated'")
    others = [v for d, v in chosen.items() if d not in EMULATED_DIMENSIONS
              and (d, v) not in (("scale_source", "default"), ("scale_source", "calibrated"))]
    if others or bf16_layers:
        raise PathSpecError(f"KV path {spec!r}: emulated takes a format, granularity, cast and the default or "
                            f"calibrated scale source only (the twin computes its own scales, no kernel, no "
                            f"attention options); got {', '.join(others) or 'a per-layer map'}")


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


def _keyed_option(spec: str, option: str) -> tuple[tuple[int, ...], bool]:
    """`keep_bf16=3+7+sliding_window` or `layers=FILE` (JSON with "bf16_layers": [..], as `harness sensitivity`
    writes) -> (layer indices, whether every sliding-window layer is kept too)."""
    key, _, value = option.partition("=")
    if key not in KEYED_OPTIONS:
        raise PathSpecError(f"KV path {spec!r}: unknown option {key!r}; key=value options are {', '.join(KEYED_OPTIONS)}")
    parts = [part.strip() for part in value.split("+")] if key == "keep_bf16" else []
    sliding = SLIDING_WINDOW in parts
    if key == "keep_bf16":
        try:
            layers = [int(part) for part in parts if part and part != SLIDING_WINDOW]
        except ValueError:
            raise PathSpecError(f"KV path {spec!r}: keep_bf16 takes layer indices and {SLIDING_WINDOW} joined by '+', "
                                f"e.g. keep_bf16=3+7 or keep_bf16={SLIDING_WINDOW} (vLLM's --kv-cache-dtype-skip-layers); "
                                f"got {value!r}") from None
        if not layers and not sliding:
            raise PathSpecError(f"KV path {spec!r}: keep_bf16= names no layer; e.g. keep_bf16=3+7 or "
                                f"keep_bf16={SLIDING_WINDOW}")
    else:
        layers = read_layer_map(spec, value)
    if any(i < 0 for i in layers):
        raise PathSpecError(f"KV path {spec!r}: negative layer index in {option!r}")
    return tuple(sorted(set(layers))), sliding


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
