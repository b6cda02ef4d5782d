"""Model families: the class that generates text for a model, what the harness does with each of its layers, and what
it refuses: from the config before any work, and from what the loaded model holds (`check_model`).

`route_facts(config, paths)` names, per layer, whether a KV path quantises it (`fp8`), keeps it in BF16 (and
why), or leaves a linear-attention / SSM state as the model keeps it; plus the attention features (GQA, MLA,
sliding windows, chunked attention, sinks, soft-capping, hybrid layers) and whether our decode kernels run.
`refusals(config, paths)` says, before any weights load, why a (family, path) cannot be replayed: one line
each, in the harness's words (which layer type, which feature, what would be needed). Both read only the
transformers config: `harness run` checks every model before the run directory exists (run_inputs.py), and
stores the facts beside the model in the manifest (executor/model_replay.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.kv_paths.decode_kernels import BEYOND_SDPA_COMPUTED, DEFAULT
from harness.model_layers import (WINDOWED, field, layer_count, layer_shape, layer_shapes, layer_types,
                                  model_cache, transformers_class)

# Families whose cache is their own class, not transformers' DynamicCache that `kv_paths.cache.build_cache`
# edits: what each would need.
OWN_CACHE = {
    "minimax": ("its lightning-attention layers keep their state in transformers' MiniMaxCache (a DynamicCache "
                "with a separate linear_cache list), not in cache layers; the FP8 KV paths edit DynamicCache "
                "layers, so replaying it needs build_cache to start from MiniMaxCache and place FP8 layers by "
                "config.layer_types"),
}

# Families whose forward cannot prefill a turn's prompt onto the cache of the turns before it (measured with
# transformers 5.24: a second cached call of more than one token raises), so no multi-turn replay runs.
NO_CACHED_PREFILL = {
    "prophetnet": "its decoder takes one new token per cached call (transformers asserts that `use_cache` is only "
                  "supported for decoder_input_ids of length 1)",
    "xlm": "its attention mask is built for the cache's first call: a second cached call of more than one token "
           "fails on the mask's shape",
}


# Attention computed beyond plain SDPA: the registered attention function runs the model's own eager attention
# for these (bit-identical to transformers' eager); the decode kernels listed in `decode_kernels.BEYOND_SDPA_COMPUTED`
# compute gpt-oss's sinks and soft-capping, the FP8-attention reference (fp8_q / fp8_p) none of them.
def beyond_sdpa_needs(config) -> dict[str, str]:
    """{the attention function's keyword: what it computes} beyond SDPA for this family: from its config (gpt-oss's
    sinks, `s_aux`; a soft-capping value) and what the loaded model handed the attention function in
    `check_model`'s probe (Inkling's sinks and position bias), as the probe recorded it on the config."""
    from harness.kv_paths.attention import BEYOND_SDPA

    needs = {}
    if getattr(config, "model_type", None) == "gpt_oss":
        needs["s_aux"] = "attention sinks"
    softcap = field(config, "attn_logit_softcapping")
    if softcap is not None:
        needs["softcap"] = f"logit soft-capping ({softcap})"
    for name in getattr(config, SEEN_BEYOND_SDPA, ()) or ():
        if name not in needs and not any(have.startswith(BEYOND_SDPA[name]) for have in needs.values()):
            needs[name] = BEYOND_SDPA[name]
    return needs


def beyond_sdpa_features(config) -> list[str]:
    """What the family's attention computes beyond SDPA, in words (`beyond_sdpa_needs`)."""
    return list(dict.fromkeys(beyond_sdpa_needs(config).values()))


SEEN_BEYOND_SDPA = "harness_attention_beyond_sdpa"  # the config attribute `check_model` records them in


def layer_routes(config) -> list[dict]:
    """One row per layer: {layer, cache (transformers' cache layer class), kv: fp8 | bf16 | state | none, why}."""
    rows = []
    for i, layer in enumerate(model_cache(config).layers):
        kind = type(layer).__name__
        rows.append({"layer": i, "cache": kind, **_route_of(kind, layer)})
    return rows


def _route_of(kind: str, layer) -> dict:
    if kind == "DynamicLayer":
        return {"kv": "fp8", "why": "full-attention KV cache: the path's FP8 cache layer"}
    from harness.kv_paths.cache import holds_kv

    if holds_kv(layer) and getattr(layer, "is_sliding", False):
        return {"kv": "fp8", "why": f"sliding-window / chunked attention KV cache ({kind}) stored FP8, its window "
                                    f"kept as transformers keeps it (all of it on static storage, windowed by the "
                                    f"mask); decode through our kernel where it computes windows, else torch attention"}
    if holds_kv(layer):
        return {"kv": "fp8", "why": f"attention K/V of {kind} stored FP8; its SSM / linear state kept as the model "
                                    f"keeps it"}
    if kind.startswith("LinearAttention"):
        return {"kv": "state", "why": "linear-attention / SSM state, kept as the model keeps it"}
    if kind == "DummyLayer":
        return {"kv": "none", "why": "no cache (an MLP / MoE-only layer)"}
    return {"kv": "bf16", "why": f"cache layer {kind}: not one the FP8 cache layers replace"}


def attention_kinds(config, routes: list[dict]) -> list[str]:
    """The matrix's attention kind: GQA / MHA / MLA, SWA, chunked, sinks, soft-capping, hybrid."""
    kinds = []
    shapes = [layer_shape(config, r["layer"]) for r in routes if r["kv"] == "fp8"] or layer_shapes(config)[:1]
    if field(config, "kv_lora_rank"):
        kinds.append("MLA")
    else:
        grouped = any(s.kv_heads and s.kv_heads < (field(config, "num_attention_heads", layer=s.layer) or 0)
                      for s in shapes)
        kinds.append("GQA" if grouped else "MHA")
    if len({(s.kv_heads, s.head_dim) for s in shapes}) > 1:
        kinds.append("per-layer heads")
    types = layer_types(config)
    if any(r["cache"] == "DynamicSlidingWindowLayer" for r in routes) and "chunked_attention" not in types:
        kinds.append("SWA")
    if "chunked_attention" in types or field(config, "attention_chunk_size"):
        kinds.append("chunked")
    kinds += ["sinks" if f == "attention sinks" else "softcap" for f in beyond_sdpa_features(config)]
    if any(r["kv"] == "state" or "LinearAttention" in r["cache"] for r in routes):
        kinds.append("hybrid")
    return kinds


def refusals(config, paths) -> list[str]:
    """Why this model cannot run these KV paths (empty: it can), decided from its config before any work."""
    family = config.model_type
    if family in OWN_CACHE:
        return [f"model family {family!r}: {OWN_CACHE[family]}"]
    if family in NO_CACHED_PREFILL:
        return [f"model family {family!r}: {NO_CACHED_PREFILL[family]}, so a turn's prompt cannot be prefilled onto "
                f"the cache of the turns before it (every multi-turn replay does); needed: its forward taking a "
                f"prompt of several tokens with a cache"]
    unloadable = model_refusal(config)
    if unloadable:
        return [unloadable]
    cross = [layer for layer in field(config, "cross_attention_layers") or () if layer < layer_count(config)]
    quantising = [p.name for p in paths if p.is_quantized or p.k_scale_on_scores]
    if cross and quantising:
        return [f"--paths {','.join(quantising)}: model family {family!r}: layers {list(cross)} are cross-attention "
                f"layers, whose cache holds the image encoder's K/V, which a text scenario never writes: no scale "
                f"can be calibrated for them and an FP8 path would quantise nothing there; needed: a route that keeps "
                f"cross-attention layers as the model keeps them"]
    routes = layer_routes(config)
    problems = []
    if quantising and not any(r["kv"] == "fp8" for r in routes):
        kept = sorted({f"{r['cache']} ({r['why']})" for r in routes if r["kv"] == "bf16"})
        problems.append(f"--paths {','.join(quantising)}: model family {family!r} has no full-attention KV layer for "
                        f"an FP8 path to quantise (its layers: {'; '.join(kept) or 'no attention KV cache'}); such a "
                        f"path would replay BF16 under an FP8 name")
    problems += [bf16_layer_problem(path, family, len(routes)) for path in paths
                 if any(layer >= len(routes) for layer in path.bf16_layers)]
    problems += layout_problems(config, paths)
    problems += [p for p in [fp8_attention_refusal(config, paths)] if p]
    return problems


def fp8_attention_refusal(config, paths) -> str | None:
    """FP8-attention paths (fp8_q / fp8_p) on a family whose attention computes more than SDPA (None: fine)."""
    beyond = beyond_sdpa_features(config)
    fp8_attention = [p.name for p in paths if p.quantizes_attention]
    if beyond and fp8_attention:
        return (f"--paths {','.join(fp8_attention)}: model family {config.model_type!r} has {' and '.join(beyond)}, "
                f"which the FP8-attention reference (fp8_q / fp8_p) does not compute; needed: those features in "
                f"kernels.reference.attention_fp8")
    return None


def model_refusal(config) -> str | None:
    """Why no model of this config can be replayed at all, from the config and transformers' classes (None: it
    may be; `check_model` decides on the loaded model): no class that generates text for it, a forward that takes
    no cache, a cache transformers cannot build for it."""
    family = config.model_type
    model_class = causal_lm_class(config)
    if model_class is None:
        from transformers import AutoModelForCausalLM

        mapped = AutoModelForCausalLM._model_mapping.get(type(config), None)  # noqa: SLF001
        auto = (f"AutoModelForCausalLM maps it to {mapped.__name__}, which takes a "
                f"{getattr(mapped.config_class, '__name__', '?')}, not a {type(config).__name__}" if mapped is not None
                else f"no AutoModelForCausalLM mapping for {type(config).__name__}")
        return (f"model family {family!r}: transformers {_version()} has no class that generates text for it "
                f"({auto}; no ...ForCausalLM / ...ForConditionalGeneration class taking it in config.json's "
                f"architectures {getattr(config, 'architectures', None)})")
    concrete = concrete_class(model_class, config)
    if concrete is not None and cache_keyword(concrete) is None:
        return (f"model family {family!r}: {concrete.__name__}.forward takes no cache (neither `cache` nor "
                f"`past_key_values`), so there is no KV cache for a path to replace")
    try:
        model_cache(config)
    except Exception as error:  # noqa: BLE001 - any failure is the family's, said in our words
        return (f"model family {family!r}: transformers {_version()} cannot build its cache from its config "
                f"(DynamicCache(config=...) raised {type(error).__name__}: {error})")
    return None


def concrete_class(model_class, config):
    """The class AutoModelForCausalLM builds for `config` (itself for a family's own class)."""
    from transformers import AutoModelForCausalLM

    if model_class is not AutoModelForCausalLM:
        return model_class
    return AutoModelForCausalLM._model_mapping.get(type(config), None)  # noqa: SLF001


def cache_keyword(model_class) -> str | None:
    """The keyword the model's forward takes its cache under (transformers 5.2x: `cache`; 5.17: `past_key_values`),
    or None for a forward that takes none."""
    import inspect

    parameters = inspect.signature(model_class.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def _version() -> str:
    import transformers

    return transformers.__version__


def layout_problems(config, paths) -> list[str]:
    """Paths whose options the model's layout cannot take: keep_bf16=sliding_window without sliding-window layers,
    a format declared for another layout (fp8_ds_mla on a GQA model), a Hadamard rotation of an MLA latent."""
    from harness.kv_paths.cache import no_sliding_window_problem, sliding_window_layers

    layout = "mla" if field(config, "kv_lora_rank") else "gqa"
    family, problems = config.model_type, []
    for path in paths:
        if path.bf16_sliding and not sliding_window_layers(config):
            problems.append(no_sliding_window_problem(path, config))
        formats = dict.fromkeys(f for f in (path.k_format, path.v_format, path.prefill_format) if f is not None)
        for kv_format in formats:
            if layout not in kv_format.layouts:
                problems.append(f"--paths {path.name}: {kv_format.spec_name} is a cache layout for "
                                f"{'/'.join(kv_format.layouts).upper()} models ({kv_format.describe()}); model family "
                                f"{family!r} is {layout.upper()}")
        if path.hadamard and layout == "mla":
            problems.append(f"--paths {path.name}: hadamard rotates per-head K over head_dim; model family {family!r} "
                            f"caches an MLA latent that kv_b_proj expands before attention (rotating it would need "
                            f"kv_b_proj's columns rotated too, which this option does not do)")
    return problems


def bf16_layer_problem(path, family: str, layers: int) -> str:
    """A path keeping in BF16 a layer the model does not have (`keep_bf16=999` on 6 layers)."""
    beyond = [str(layer) for layer in path.bf16_layers if layer >= layers]
    return (f"--paths {path.name}: keeps layer {', '.join(beyond)} in BF16, but model family {family!r} has {layers} "
            f"layers (0-{layers - 1})")


def kernel_block(config, computed: frozenset[str] | set[str] = frozenset()) -> str | None:
    """Why a decode kernel that computes `computed` (keywords of `beyond_sdpa_needs`) must not run for this model
    (None: it may), said in the route."""
    missing = [text for name, text in beyond_sdpa_needs(config).items() if name not in computed]
    if missing:
        return (f"{' and '.join(dict.fromkeys(missing))}: the decode kernel does not compute them, so decode runs "
                f"torch attention as the model defines it")
    return None


# layer types transformers gives no cache (DummyLayer; 5.17 gave them an unused LinearAttentionLayer)
NO_CACHE_TYPES = ("mlp", "moe")


def static_decode_refusal(config) -> str | None:
    """Why a model cannot decode on static storage (None: it can): layer kinds whose cache is not an attention
    cache (full, sliding-window or chunked; attention beside an SSM state: "hybrid"), a fixed-shape
    linear-attention or convolution state, or nothing (an MLP / MoE-only layer). A sliding-window or chunked
    layer keeps every token on static storage and attends to its window through the mask
    (`batched.static_mask`): the same keys its growing cache keeps (the last window - 1 tokens and the new one).
    Refused: indexer keys (sparse attention), which grow another way; a window beside an SSM state
    ("hybrid_sliding": only Inkling has it, and its position bias refuses it anyway); a position bias (Inkling's:
    computed from the cache's own sizes and offsets, which static storage's left-padded columns do not give)."""
    other = set(layer_types(config)) - {"full_attention", "linear_attention", "conv", "hybrid", *NO_CACHE_TYPES,
                                        *WINDOWED}
    if other:
        return f"layer types {sorted(other)}"
    if "position_bias" in (getattr(config, SEEN_BEYOND_SDPA, ()) or ()):
        return "a position bias computed from the cache's sizes"
    windows: dict[str, set] = {}
    for shape in layer_shapes(config):
        if shape.window:
            windows.setdefault(shape.kind, set()).add(shape.window)
    several = {kind: sorted(sizes) for kind, sizes in windows.items() if len(sizes) > 1}
    if several:  # the model takes one mask per layer type
        return f"several windows for one layer type {several}"
    return None


def stack_refusal(config) -> str | None:
    """Why one-sequence caches of this model cannot be stacked into rows (`cache.stack_rows`; None: they can): a
    static-storage refusal, or a window (a row's window cache holds its last window - 1 tokens, not its prompt)."""
    refusal = static_decode_refusal(config)
    if refusal is not None:
        return refusal
    if "hybrid" in layer_types(config):  # `stack_rows` pads K/V or joins states, not both in one layer
        return "layer type 'hybrid' (attention K/V beside an SSM state)"
    windows = sorted({s.window for s in layer_shapes(config) if s.window})
    if windows:
        return f"sliding window {windows[0]}" if len(windows) == 1 else f"sliding windows {windows}"
    return None


def route_facts(config, paths) -> dict:
    """What the manifest stores for one model: family, attention kinds, per-layer route, BF16 layers and why."""
    routes = layer_routes(config)
    facts = {"family": config.model_type, "attention": attention_kinds(config, routes), "layers": routes,
             "fp8_layers": [r["layer"] for r in routes if r["kv"] == "fp8"],
             "kept_bf16": {str(r["layer"]): r["why"] for r in routes if r["kv"] == "bf16"}}
    block = kernel_block(config, BEYOND_SDPA_COMPUTED[DEFAULT])
    if block:
        facts["decode_kernels"] = f"off: {block}"
    static = static_decode_refusal(config)
    if static:  # CUDA graph decode needs static storage; these decode batched on the growing cache
        facts["graph_decode"] = f"off: no static storage for {static} (batched dynamic decode instead)"
    for path in paths:
        if path.bf16_layers:
            facts["kept_bf16"].update({f"{i} ({path.name})": "the path's layers= option" for i in path.bf16_layers})
        if path.bf16_sliding:
            from harness.kv_paths.cache import sliding_window_layers

            facts["kept_bf16"].update({f"{i} ({path.name})": "the path's keep_bf16=sliding_window (a sliding-window "
                                                             "layer)" for i in sliding_window_layers(config)})
    return facts


def causal_lm_class(config):
    """The class that generates text for `config`: AutoModelForCausalLM where its mapping lists the config's type,
    else the `...ForCausalLM` / `...ForConditionalGeneration` class the config names (`architectures`, as
    save_pretrained writes it) when that class takes this config (Mistral 4, Mllama's text model, a Musicgen
    decoder have no Auto mapping); None when neither."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping  # noqa: SLF001 - the mapping from_pretrained consults
    if type(config) in mapping and _takes(mapping[type(config)], config):
        return AutoModelForCausalLM
    for name in getattr(config, "architectures", None) or ():
        found = transformers_class(name, config.model_type)
        if (found is not None and name.endswith(("ForCausalLM", "ForConditionalGeneration"))
                and isinstance(config, getattr(found, "config_class", ()) or ())):
            return found
    return None


def _takes(model_class, config) -> bool:
    """Whether `model_class` builds from `config`, as AutoModelForCausalLM.from_config would: not when the class
    takes one of the config's sub-configs other than its text config (Musicgen's composite config maps to
    MusicgenForCausalLM, which takes the decoder sub-config); a family whose config another family's class takes
    (EXAONE's, LlamaForCausalLM) builds."""
    wanted = getattr(model_class, "config_class", None)
    subs = dict(getattr(config, "sub_configs", None) or {})
    return wanted is None or subs.get("text_config") == wanted or wanted not in subs.values()


def config_of(directory: Path):
    """The transformers config of a model directory (a stress variant's base), or None if it has none; ValueError
    naming the directory when transformers cannot read it."""
    from transformers import AutoConfig

    from harness.canary.variants import read_variant

    variant = read_variant(Path(directory))
    where = variant.base if variant is not None else Path(directory)
    if not (where / "config.json").is_file():
        return None
    try:
        return AutoConfig.from_pretrained(str(where))
    except Exception as error:  # noqa: BLE001 - any of transformers' config errors (a field's strict validation,
        # an unknown model type, a sub-config it cannot build): exit 2 naming the file, not a traceback
        words = " ".join(str(error).split())
        family = _declared_model_type(where / "config.json")
        named = f"model family {family!r}: " if family else ""
        raise ValueError(f"model {where}: {named}transformers {_version()} cannot read its config.json "
                         f"({type(error).__name__}: {words[:300]})") from None


def _declared_model_type(config_json: Path) -> str | None:
    """config.json's own `model_type`, read as JSON (for naming a family whose config transformers rejects)."""
    try:
        declared = json.loads(config_json.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return declared if isinstance(declared, str) else None


# -- memory a batch's prefill asks for beyond the KV cache ---------------------------------------------------
def ssm_scan_bytes(config, max_len: int) -> int:
    """Peak bytes one sequence's prefill takes in a Mamba-2 layer's chunked scan when transformers runs its torch
    fallback (no mamba_ssm kernels): transformers' Mamba-2 `torch_forward` (seen in 5.14.1; 5.24 contracts it
    with einsum instead) forms G = C[..., None, :, :] * B[..., None, :, :, :] of shape (chunks, chunk, chunk,
    heads, d_state) in fp32 before summing d_state away. With the Mamba-2 defaults (chunk 256, 128 heads,
    d_state 256) that is 8 GiB per 256-token chunk and sequence, whatever the hidden size: 24 GiB is 3 of them,
    the allocation a hidden-64 Granite-MoE-hybrid asked for on an H100 with transformers 5.17 (not re-measured
    here: no GPU). Counted as a worst case whatever the version. Zero for a model without Mamba-2 layers."""
    heads = field(config, "mamba_n_heads") or field(config, "mamba_num_heads")
    state = field(config, "mamba_d_state") or field(config, "ssm_state_size")
    chunk = field(config, "mamba_chunk_size") or field(config, "chunk_size")
    if not (heads and state and chunk) or not isinstance(chunk, int):
        return 0
    chunks = -(-max(1, max_len) // chunk)
    return chunks * chunk * chunk * heads * state * 4  # 4 = fp32 bytes


def check_loadable(weights: Path) -> str | None:
    """At model load: a family the in-process backend cannot replay at all raises ValueError (exit 2) before the
    weights load; otherwise the reason our decode kernels must stay off for it, or None."""
    config = config_of(weights)
    if config is None:
        return None
    if config.model_type in OWN_CACHE:
        raise ValueError(f"model {weights}: model family {config.model_type!r}: {OWN_CACHE[config.model_type]}")
    refusal = model_refusal(config)
    if refusal:
        raise ValueError(f"model {weights}: {refusal}")
    return kernel_block(config, BEYOND_SDPA_COMPUTED[DEFAULT])


def load_model(weights: Path, **kwargs):
    """`from_pretrained` through `causal_lm_class`; transformers' failure to build or load the family (a package it
    needs, weights it cannot read) raises ValueError naming the family (exit 2, before any work)."""
    config = config_of(weights)
    model_class = causal_lm_class(config)
    try:
        return model_class.from_pretrained(str(weights), **kwargs)
    except KeyError as error:
        if error.args and error.args[0] == kwargs.get("attn_implementation"):  # Falcon: attention classes by name
            raise ValueError(f"model {weights}: model family {config.model_type!r}: its attention takes no registered "
                             f"attention function (transformers {_version()} picks its attention classes by name: "
                             f"KeyError {error.args[0]!r}), and the harness's paths, capture and kernels attach "
                             f"through one") from None
        raise ValueError(f"model {weights}: model family {config.model_type!r}: transformers {_version()} cannot "
                         f"load it (KeyError: {error})") from None
    except Exception as error:  # noqa: BLE001 - said in our words, transformers' own in brackets
        raise ValueError(f"model {weights}: model family {config.model_type!r}: transformers {_version()} cannot "
                         f"load it ({type(error).__name__}: {str(error).strip()[:300]})") from None


def model_from_config(config, **kwargs):
    """A model of `config` with fresh weights, through `causal_lm_class` (the meta-device skeletons and random
    weights of the sharded loads)."""
    model_class = causal_lm_class(config)
    build = getattr(model_class, "from_config", None) if model_class.__name__.startswith("Auto") else None
    return build(config, **kwargs) if build is not None else model_class._from_config(config, **kwargs)


# -- what the loaded model holds -------------------------------------------------------------------------------
# a chat as short as a scenario's first turn: a forward of it shows where the model keeps its state
PROBE_CHAT = [{"role": "system", "content": "End every answer with the word Thanks."},
              {"role": "user", "content": "What plans do you offer, and at what price?"}]


def check_model(model, tokenizer, label: str) -> None:
    """Raise ValueError (exit 2, before any work) for a loaded model whose state the KV paths cannot hold: a
    forward of PROBE_CHAT (through the tokenizer's chat template, as a scenario's prompt) with the cache a path
    would use must work, fill at least one cache layer with attention K/V (one position per token), return that
    same cache, and leave no tensor state on the model's modules (state there is shared by the reference and every
    path, so no path replays alone). Refusals name the family and where its state is. What the model handed the
    attention function beyond SDPA is recorded on its config (`beyond_sdpa_features` reads it)."""
    problem = _shared_attention(model) or _probe(model, tokenizer)
    if problem:
        raise ValueError(f"model {label}: model family {model.config.model_type!r}: {problem}")


def _shared_attention(model) -> str | None:
    """Zamba's one attention block, called at several layers with the layer's index as an argument."""
    shared = sorted({name for name, module in model.named_modules() if "Attention" in type(module).__name__
                     and hasattr(module, "layer_idx") and module.layer_idx is None})
    if shared:
        return (f"its attention modules {', '.join(shared[:3])} have no layer index of their own (one block shared by "
                f"several layers), and the harness finds a layer's cache by its attention module's layer_idx")
    return None


def _probe(model, tokenizer) -> str | None:
    import torch

    from harness.kv_paths.cache import build_cache, cache_kwargs
    from harness.forward_context import forward_context

    ids = torch.tensor([_probe_ids(tokenizer)]).to(model.device)
    cache = build_cache(model.config, None, None)
    before, seen = _module_state(model), set()
    try:
        # no cache in the context: the model's own attention over a plain cache, recording what it hands the
        # attention function beyond SDPA
        with torch.inference_mode(), forward_context(seen_beyond_sdpa=seen):
            out = model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    except Exception as error:  # noqa: BLE001 - the family's forward, said in our words
        return _forward_failure(model, ids, error)
    setattr(model.config, SEEN_BEYOND_SDPA, sorted(seen))  # route and refusals read it (`beyond_sdpa_features`)
    moved = sorted(name for name, value in _module_state(model).items() if before.get(name) is not value)
    if moved:
        return (f"it keeps state on its modules ({', '.join(moved[:4])}{', ...' if len(moved) > 4 else ''}), not in "
                f"the cache a path builds: the reference and every path would share it, so no path replays alone")
    returned = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    if returned is not None and returned is not cache:
        return (f"it keeps its state in its own cache ({type(returned).__name__}), not in the cache a path builds, "
                f"which stays empty: an FP8 path would replay BF16 under an FP8 name")
    return _held_problem(cache, ids.shape[1])


def _held_problem(cache, tokens: int) -> str | None:
    """What is wrong with what the probe left in the cache (None: K/V in some layer, one position per token)."""
    from harness.kv_paths.cache import holds_kv

    held = [layer for layer in cache.layers
            if holds_kv(layer) and getattr(layer, "keys", None) is not None and layer.keys.numel()]
    if not held:
        kinds = ", ".join(sorted({type(layer).__name__ for layer in cache.layers}))
        return (f"after a forward pass no layer of its cache holds attention K/V ({kinds}): its state is recurrent / "
                f"SSM state the FP8 KV paths do not quantise, so an FP8 path would replay BF16 under an FP8 name")
    lengths = sorted({layer.keys.shape[-2] for layer in held if type(layer).__name__ == "DynamicLayer"})
    if lengths and lengths != [tokens]:  # CPM-Ant prepends its own prompt positions to every input
        return (f"after a {tokens}-token prompt its cache holds {', '.join(map(str, lengths))} positions: it adds "
                f"positions of its own, and the harness's masks and positions count the prompt's tokens")
    return None


def _forward_failure(model, ids, error: Exception) -> str:
    """Why the probe's forward failed: the family's own cache class when a forward without ours works (xLSTM),
    else transformers' error itself."""
    import torch

    said = f"{type(error).__name__}: {str(error).strip()[:300]}"
    from harness.forward_context import forward_context

    try:
        with torch.inference_mode(), forward_context():
            out = model(input_ids=ids, use_cache=True)
        own = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    except Exception:  # noqa: BLE001 - it fails either way: transformers' own error is the reason
        own = None
    if own is not None:
        return (f"it keeps its state in its own cache ({type(own).__name__}) and its forward fails with the cache a "
                f"path builds ({said})")
    return f"its forward on a {ids.shape[1]}-token prompt fails in transformers {_version()} ({said})"


def _probe_ids(tokenizer) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a tokenizer without a chat template: the messages' text
        text = "\n".join(m["content"] for m in PROBE_CHAT)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _module_state(model) -> dict[str, object]:
    """Tensors (and lists / tuples / dicts holding them) set as plain attributes on the model's modules, by name:
    not parameters or buffers, which the weights own."""
    import torch

    state = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if name.startswith("_"):
                continue
            if isinstance(value, torch.Tensor) or (isinstance(value, (list, tuple, dict)) and any(
                    isinstance(v, torch.Tensor) for v in (value.values() if isinstance(value, dict) else value))):
                state[f"{prefix}.{name}" if prefix else name] = value
    return state
