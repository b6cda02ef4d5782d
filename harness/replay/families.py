"""Model families: what the harness does with each layer of a model, and what it refuses, from the config alone.

`route_facts(config, paths)` names, per layer, whether a KV path quantises it (`fp8`), keeps it in BF16 (and
why), or leaves a linear-attention / SSM state as the model keeps it; plus the attention features (GQA, MLA,
sliding windows, chunked attention, sinks, soft-capping, hybrid layers) and whether our decode kernels run.
`refusals(config, paths)` says, before any weights load, why a (family, path) cannot be replayed: one line
each, in the harness's words (which layer type, which feature, what would be needed). Both read only the
transformers config: `harness run` checks every model before the run directory exists (run_inputs.py), and
stores the facts beside the model in the manifest (executor/model_replay.py).
"""

from __future__ import annotations

from pathlib import Path

# Families whose cache is their own class, not transformers' DynamicCache that `kv_paths.cache.build_cache`
# edits: what each would need.
OWN_CACHE = {
    "minimax": ("its lightning-attention layers keep their state in transformers' MiniMaxCache (a DynamicCache "
                "with a separate linear_cache list), not in cache layers; the FP8 KV paths edit DynamicCache "
                "layers, so replaying it needs build_cache to start from MiniMaxCache and place FP8 layers by "
                "config.layer_types"),
}

# Attention computed beyond plain SDPA: the registered attention function runs the model's own eager attention
# for these (bit-identical to transformers' eager), but neither our decode kernels nor the FP8-attention
# reference (fp8_q / fp8_p) compute them.
def beyond_sdpa_features(config) -> list[str]:
    features = []
    if getattr(config, "model_type", None) == "gpt_oss":
        features.append("attention sinks")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        features.append(f"logit soft-capping ({config.attn_logit_softcapping})")
    return features


def layer_routes(config) -> list[dict]:
    """One row per layer: {layer, cache (transformers' cache layer class), kv: fp8 | bf16 | state | none, why}."""
    from transformers import DynamicCache

    rows = []
    for i, layer in enumerate(DynamicCache(config=config).layers):
        kind = type(layer).__name__
        rows.append({"layer": i, "cache": kind, **_route_of(kind, layer)})
    return rows


def _route_of(kind: str, layer) -> dict:
    if kind == "DynamicLayer":
        return {"kv": "fp8", "why": "full-attention KV cache: the path's FP8 cache layer"}
    from harness.kv_paths.cache import holds_kv

    if holds_kv(layer) and getattr(layer, "is_sliding", False):
        return {"kv": "fp8", "why": f"sliding-window / chunked attention KV cache ({kind}) stored FP8, its window "
                                    f"kept as transformers keeps it; decode through torch attention (our paged "
                                    f"kernels read no window)"}
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
    if getattr(config, "kv_lora_rank", None):
        kinds.append("MLA")
    else:
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
        kinds.append("GQA" if kv_heads and kv_heads < heads else "MHA")
    layer_types = list(getattr(config, "layer_types", None) or [])
    if any(r["cache"] == "DynamicSlidingWindowLayer" for r in routes) and "chunked_attention" not in layer_types:
        kinds.append("SWA")
    if "chunked_attention" in layer_types or getattr(config, "attention_chunk_size", None):
        kinds.append("chunked")
    kinds += ["sinks" if f == "attention sinks" else "softcap" for f in beyond_sdpa_features(config)]
    if any(r["kv"] == "state" or "FullAttention" in r["cache"] for r in routes):
        kinds.append("hybrid")
    return kinds


def refusals(config, paths) -> list[str]:
    """Why this model cannot run these KV paths (empty: it can), decided from its config before any work."""
    family = config.model_type
    if family in OWN_CACHE:
        return [f"model family {family!r}: {OWN_CACHE[family]}"]
    routes = layer_routes(config)
    problems = []
    quantising = [p.name for p in paths if p.is_quantized or p.k_scale_on_scores]
    if quantising and not any(r["kv"] == "fp8" for r in routes):
        kept = sorted({f"{r['cache']} ({r['why']})" for r in routes if r["kv"] == "bf16"})
        problems.append(f"--paths {','.join(quantising)}: model family {family!r} has no full-attention KV layer for an "
                        f"FP8 path to quantise (its layers: {'; '.join(kept) or 'no attention KV cache'}); such a "
                        f"path would replay BF16 under an FP8 name")
    problems += [bf16_layer_problem(path, family, len(routes)) for path in paths
                 if any(layer >= len(routes) for layer in path.bf16_layers)]
    problems += layout_problems(config, paths)
    beyond = beyond_sdpa_features(config)
    fp8_attention = [p.name for p in paths if p.quantizes_attention]
    if beyond and fp8_attention:
        problems.append(f"--paths {','.join(fp8_attention)}: model family {family!r} has {' and '.join(beyond)}, which "
                        f"the FP8-attention reference (fp8_q / fp8_p) does not compute; needed: those features in "
                        f"kernels.reference.attention_fp8")
    return problems


def layout_problems(config, paths) -> list[str]:
    """Paths whose options the model's layout cannot take: keep_bf16=sliding_window without sliding-window layers,
    a format declared for another layout (fp8_ds_mla on a GQA model), a Hadamard rotation of an MLA latent."""
    from harness.kv_paths.cache import no_sliding_window_problem, sliding_window_layers

    layout = "mla" if getattr(config, "kv_lora_rank", None) else "gqa"
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


def kernel_block(config) -> str | None:
    """Why our decode kernels must not run for this model (None: they may), said in the route."""
    beyond = beyond_sdpa_features(config)
    if beyond:
        return (f"{' and '.join(beyond)}: our decode kernels do not compute them, so decode runs the model's own "
                f"eager attention")
    return None


def static_decode_refusal(config) -> str | None:
    """Why a model cannot decode on static storage (None: it can): layer kinds whose cache is not a full
    attention cache or a fixed-shape linear-attention state (sliding windows, chunked attention, ...)."""
    kinds = set(getattr(config, "layer_types", None) or ("full_attention",))
    other = kinds - {"full_attention", "linear_attention"}
    if other:
        return f"layer types {sorted(other)}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding window {config.sliding_window}"
    return None


def route_facts(config, paths) -> dict:
    """What the manifest stores for one model: family, attention kinds, per-layer route, BF16 layers and why."""
    routes = layer_routes(config)
    facts = {"family": config.model_type, "attention": attention_kinds(config, routes), "layers": routes,
             "fp8_layers": [r["layer"] for r in routes if r["kv"] == "fp8"],
             "kept_bf16": {str(r["layer"]): r["why"] for r in routes if r["kv"] == "bf16"}}
    block = kernel_block(config)
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


def config_of(directory: Path):
    """The transformers config of a model directory (a stress variant's base), or None if it has none."""
    from transformers import AutoConfig

    from harness.canary.variants import read_variant

    variant = read_variant(Path(directory))
    where = variant.base if variant is not None else Path(directory)
    return AutoConfig.from_pretrained(str(where)) if (where / "config.json").is_file() else None


# -- memory a batch's prefill asks for beyond the KV cache ---------------------------------------------------
def ssm_scan_bytes(config, max_len: int) -> int:
    """Peak bytes one sequence's prefill takes in a Mamba-2 layer's chunked scan when transformers runs its torch
    fallback (no mamba_ssm kernels): transformers' Mamba-2 `torch_forward` (seen in 5.14.1; 5.24 contracts it
    with einsum instead) forms G = C[..., None, :, :] * B[..., None, :, :, :] of shape (chunks, chunk, chunk,
    heads, d_state) in fp32 before summing d_state away. With the Mamba-2 defaults (chunk 256, 128 heads,
    d_state 256) that is 8 GiB per 256-token chunk and sequence, whatever the hidden size: 24 GiB is 3 of them,
    the allocation a hidden-64 Granite-MoE-hybrid asked for on an H100 with transformers 5.17 (not re-measured
    here: no GPU). Counted as a worst case whatever the version. Zero for a model without Mamba-2 layers."""
    heads = getattr(config, "mamba_n_heads", None) or getattr(config, "mamba_num_heads", None)
    state = getattr(config, "mamba_d_state", None) or getattr(config, "ssm_state_size", None)
    chunk = getattr(config, "mamba_chunk_size", None) or getattr(config, "chunk_size", None)
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
    return kernel_block(config)
