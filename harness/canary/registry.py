"""Every causal-decoder family the installed transformers ships, and a tiny random-weight model of each, built
from its registry: the model types of `AutoModelForCausalLM`'s mapping, plus those with a `...ForCausalLM`
class of their own that the mapping does not list (Mistral 4, a Musicgen decoder, ...).

A tiny config starts from the family's own config class (its defaults: layer types, windows, indexer, experts,
per-layer head sizes) and shrinks every size field it has by name (`_SIZE_RULES`): hidden 64, heads 4 of 16
dims, 4 layers chosen so that every distinct kind of layer the default model has is kept (`_kept_layers`),
the canary tokenizer's 128-token vocabulary. Sub-configs (text, vision, audio) shrink the same way. A family
whose defaults need more than these rules says so in `_FAMILY_OVERRIDES`, with the reason.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

from harness.canary.tokenizer import VOCAB_SIZE, save_tokenizer

FAMILY_LAYERS = 4
_WINDOW = 16  # shorter than the matrix's prompts, so a window is really applied
_HIDDEN, _FFN, _EXPERT_FFN, _HEADS, _HEAD_DIM, _RANK = 64, 128, 32, 4, 16, 32
# multimodal placeholder ids (image, audio, video, begin/end of ...) sit in the canary vocabulary's unused tail
# (102 tokens used of 128), so no prompt character ever reads as an image
_FREE_IDS = range(VOCAB_SIZE - 1, 101, -1)

# field name -> tiny value (or a function of the default value); a field only shrinks where the config has it
_SIZE_RULES: dict[str, object] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embedding_dim", "emb_dim",
                     "lru_width", "word_embed_proj_dim", "input_embedding_size", "output_embedding_size",
                     "embedding_size", "backbone_hidden_size", "hidden_dim", "embed_dim", "adapter_in_dim",
                     "adapter_out_dim",
                     "adapter_input_size"), _HIDDEN),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size",
                     "d_inner", "dff", "dim_ff", "feed_forward_size", "intermediate_size_mlp", "d_ff",
                     "dense_intermediate_size"), _FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size"), _EXPERT_FFN),
    "shared_intermediate_size": lambda v: _EXPERT_FFN if v else v,
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                     "decoder_attention_heads", "encoder_attention_heads", "num_decoder_attention_heads",
                     "num_encoder_attention_heads", "swa_num_attention_heads", "linear_num_heads",
                     "linear_num_value_heads", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads"),
                    _HEADS),
    **dict.fromkeys(("head_dim", "attention_head_size", "d_head", "dim_head", "kv_channels", "swa_head_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "index_head_dim",
                     "qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim", "d_rel"),
                    _HEAD_DIM),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 32),
    "qk_head_dim": 2 * _HEAD_DIM,  # nope + rope
    "rotary_dim": _HEAD_DIM // 2,
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "o_lora_rank", "adapter_rank", "hc_lowrank", "router_hidden_size",
                     "loop_gate_rank"), _RANK),
    **dict.fromkeys(("laurel_rank", "gated_norm_rank", "time_step_rank", "mamba_dt_rank", "ple_embed_dim",
                     "hidden_size_per_layer_input"), 8),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts"), 2),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group", "n_shared_experts", "num_shared_experts",
                     "moe_num_shared_experts", "n_groups", "mamba_n_groups", "mamba_ngroups"), 1),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 16),
    **dict.fromkeys(("chunk_size", "mamba_chunk_size"), 16),
    "mamba_d_ssm": 128,  # mamba heads x mamba head size
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "unpadded_vocab_size"),
                    VOCAB_SIZE),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "context_length",
                     "max_seq_len", "model_max_length", "original_max_position_embeddings"), 2048),
    **dict.fromkeys(("sliding_window", "attention_chunk_size", "attention_window_size", "window_size",
                     "local_attention", "sliding_window_size", "local_attention_window_len"), _WINDOW),
    **dict.fromkeys(("index_topk", "index_n_heads"), lambda v: min(v, 8) if v else v),
    "index_topk_blocks": lambda v: min(v, 2) if v else v,
    "index_block_size": lambda v: min(v, 8) if v else v,
}
# head counts: GQA keeps a group (4 query heads over 2), MHA stays MHA, MQA stays MQA
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "linear_num_key_heads",
             "num_query_groups")
# token ids: the canary tokenizer's (no BOS, EOS 2, pad 0)
_TOKEN_IDS = {"bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0, "decoder_start_token_id": 0,
              "forced_eos_token_id": None}
# fields that count layers (-> the tiny number) and per-layer lists of the layers' kinds (-> the kept layers')
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers",
                 "num_blocks", "layers")
# an encoder-decoder family's decoder-only class builds its cache from the encoder's count (Bart's num_hidden_layers)
_ENCODER_LAYER_COUNTS = ("encoder_layers", "num_encoder_layers")
# fields placing a kind of layer by index or period, mapped onto the kept layers
_LAYER_INDICES = ("attn_layer_indices", "full_attn_idxs", "moe_layers", "mlp_only_layers", "hybrid_layer_ids",
                  "ple_layer_ids")

# sizes a config may leave None although its model needs them (the default config of hunyuan_v1, ministral,
# nemotron, dots1 does not build in transformers 5.24; their checkpoints set these): the tiny value
_NONE_SIZES = {"head_dim": _HEAD_DIM, "num_key_value_heads": _HEADS, "n_routed_experts": 4,
               "num_experts_per_tok": 2, "moe_intermediate_size": _EXPERT_FFN, "n_shared_experts": 1}
_NO_ATTENTION_DEFAULT = "its default config places no attention layer; its checkpoints do"

# families whose defaults the rules above cannot shrink alone: fields -> values, and why
_FAMILY_OVERRIDES: dict[str, tuple[dict, str]] = {
    "bamba": (dict(attn_layer_indices=[1, 3]), _NO_ATTENTION_DEFAULT + " (Bamba-9B: layers 9, 18, 27)"),
    "granitemoehybrid": (dict(layer_types=["mamba", "attention"] * 2), _NO_ATTENTION_DEFAULT),
    "lfm2_moe": (dict(layer_types=["conv", "full_attention"] * 2),
                 "its default config leaves layer_types None, which its model cannot build"),
    "cohere_compass_text": (dict(rope_parameters=dict.fromkeys(("full_attention", "sliding_attention"),
                                                               {"rope_type": "default", "rope_theta": 10000.0})),
                            "its default rope_parameters ({}) name no layer type, which its model cannot build"),
    "dbrx": (dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}),
             "its default attention config lacks rope_theta and clip_qkv, which its model reads (DBRX: 8)"),
    "dory": (dict(layer_types=["sliding_attention"] * 3 + ["full_attention"], n_input_layers=1, n_recurrent_layers=2,
                  n_output_layers=1), "its config lists each layer twice (attention, mlp) and its input, recurrent and "
                                      "output layers must add up to its layers"),
    "dots3_note_text": (dict(head_dim=3 * _HEAD_DIM), "its sliding-window layers' head size is their qk_nope (32 "
                                                      "here, twice the others') + qk_rope"),
    "dots3_note": (dict(text_config=dict(head_dim=3 * _HEAD_DIM)), "as dots3_note_text"),
    "mamba2": (dict(head_dim=32), "hidden x expand must be heads x head_dim (64 x 2 = 4 x 32)"),
    "gemma4_assistant": (dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
                         "its default config does not build: a drafter takes no per-layer inputs"),
    "inkling2_loop_text": (dict(n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=3),
                           "its loop bounds must be multiples of the attention-residual block"),
    "qwen4_exp_text": (dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=_HEAD_DIM, indexer_budget=8,
                            indexer_compress_ratio=2),
                       "its default config leaves the indexed layers' indexer unsized"),
    "qwen4_exp": (dict(text_config=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=_HEAD_DIM,
                                        indexer_budget=8, indexer_compress_ratio=2)), "as qwen4_exp_text"),
    "reformer": (dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[32, 64]),
                 "its axial position embeddings must sum to the hidden size and multiply to the positions"),
    "xmod": (dict(default_language="en_XX"), "its adapters need a language"),
    "xlstm": (dict(qk_dim_factor=1.0), "its native chunkwise kernel fails at 4 heads of 8 qk dims (factor 0.5)"),
    "zaya": (dict(num_experts_per_tok=1), "it supports one expert per token only"),
}


def causal_model_types() -> dict[str, str]:
    """{model type: the class that generates text for it}: AutoModelForCausalLM's mapping, plus every
    `...ForCausalLM` class in transformers' modelling sources whose config type that mapping does not list."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    found.update(_own_causal_classes(frozenset(found.values())))
    return dict(sorted(found.items()))


@functools.cache
def _own_causal_classes(mapped: frozenset[str]) -> dict[str, str]:
    """Model types served by a `...ForCausalLM` class the Auto mapping does not list, or lists under another
    type (MllamaForCausalLM serves mllama_text_model): found in the sources, then imported to read the config
    type (a class whose module will not import is left out)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    type_of_config = {name: model_type for model_type, name in CONFIG_MAPPING_NAMES.items()}
    own: dict[str, str] = {}
    header = re.compile(r"^class (\w+ForCausalLM)\([^\n]*\n((?:[ \t]+[^\n]*\n|\n){0,8})", re.M)
    models = Path(transformers.__file__).parent / "models"
    for source in sorted(models.glob("*/modeling_*.py")):
        for name, body in header.findall(source.read_text(encoding="utf-8")):
            annotated = re.search(r"^\s+config(?:_class)?\s*[:=]\s*\"?(\w+)|self, config: (\w+)", body, re.M)
            annotated = annotated and (annotated.group(1) or annotated.group(2))
            if annotated in type_of_config:
                model_type = type_of_config[annotated]
            elif name in mapped:
                continue
            else:
                model_type = _config_type_of_class(name)
            if model_type and model_type in CONFIG_MAPPING_NAMES:
                own.setdefault(model_type, name)
    return own


def _config_type_of_class(name: str) -> str | None:
    from harness.model_layers import transformers_class

    found = transformers_class(name)
    return getattr(getattr(found, "config_class", None), "model_type", None)


def build_model(model_type: str, config):
    """A random-weight model of `config` through the class that generates text for `model_type`: AutoModelForCausalLM
    where its mapping lists the type (a composite config builds its text model, as from_pretrained would), else the
    family's own class."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from harness.model_layers import transformers_class

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM.from_config(config)
    return transformers_class(causal_model_types()[model_type], model_type)._from_config(config)


# -- tiny configs ----------------------------------------------------------------------------------------------
def tiny_config(model_type: str):
    """The tiny config of `model_type`: its config class's defaults with every size field shrunk."""
    from transformers import AutoConfig

    overrides, _why = _FAMILY_OVERRIDES.get(model_type, ({}, ""))
    try:
        default = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - a default that does not build (gemma4_assistant): with the overrides
        default = AutoConfig.for_model(model_type, **overrides)
    return _tiny_config(default, overrides)


def _tiny_config(config, overrides: dict | None = None):
    overrides = dict(overrides or {})
    subs = {name: _tiny_config(getattr(config, name), overrides.pop(name, None))
            for name in _sub_config_names(config)}
    return type(config)(**{**_tiny_fields(config), **subs, **overrides})


def _sub_config_names(config) -> list[str]:
    return [name for name in (getattr(config, "sub_configs", None) or {})
            if hasattr(getattr(config, name, None), "to_dict")]


_NOT_PASSED = ("architectures", "transformers_version", "_name_or_path", "id2label", "label2id", "model_type", "dtype",
               "torch_dtype", "output_attentions", "output_hidden_states", "return_dict", "problem_type",
               "chunk_size_feed_forward", "is_encoder_decoder", "allow_global_per_layer_attribute_access",
               "per_layer_config", "rope_parameters", "rope_scaling")


def _tiny_fields(config) -> dict:
    """The config's own fields (as its constructor takes them) with sizes, layers and token ids made tiny. A field
    the class declares None and the config derived (head_dim from the hidden size, ...) is left out, to be derived
    again from the tiny sizes; per-layer lists are kept, on the kept layers."""
    config.allow_global_per_layer_attribute_access = True  # the defaults; per-layer values come in `_tiny_layers`
    try:
        everything = config.to_dict()
    finally:
        config.allow_global_per_layer_attribute_access = False
    fields = {k: v for k, v in everything.items() if k not in _NOT_PASSED}
    derived = _declared_none(type(config))
    free = iter(_FREE_IDS)
    tiny: dict = {}
    for name, value in fields.items():
        if name in _sub_config_names(config) or isinstance(value, dict) and "model_type" in value:
            continue
        if name in _SIZE_RULES and isinstance(value, int) and not isinstance(value, bool) and value:  # 0: off
            rule = _SIZE_RULES[name]
            tiny[name] = rule(value) if callable(rule) else rule
        elif name in _TOKEN_IDS:
            tiny[name] = _TOKEN_IDS[name]
            if name == "bos_token_id" and value is not None:  # a config that insists on one: an id never in a prompt
                tiny[name] = next(free)
        elif re.fullmatch(r"\w+_token_(id|index)", name) and isinstance(value, int) and value >= 100:
            tiny[name] = next(free)
        else:
            tiny[name] = value
        if name in derived and value is not None and not isinstance(value, list) and name not in _TOKEN_IDS:
            tiny.pop(name)  # derived again from the tiny sizes
    _proportional_sizes(fields, tiny)
    for name, value in _NONE_SIZES.items():
        if name in fields and fields[name] is None:
            tiny[name] = value
    heads = fields.get("num_attention_heads") or fields.get("n_head") or fields.get("num_heads")
    for name in _KV_HEADS:
        if isinstance(fields.get(name), int) and name not in derived:
            kv = fields[name]
            tiny[name] = _HEADS if heads and kv == heads else 1 if kv == 1 else 2
    if "is_decoder" in fields or hasattr(config, "is_decoder"):
        tiny["is_decoder"] = True  # an encoder family's LM head generates only as a decoder (BertLMHeadModel)
    _tiny_layers(fields, tiny, everything.get("per_layer_config") or {})
    return tiny


def _proportional_sizes(fields: dict, tiny: dict) -> None:
    """Sizes defined by others, kept in proportion: Zamba's attention runs on hidden + embeddings (twice the hidden
    size) over its heads; an MLA config's head_dim is its RoPE part (DeepSeek) or nope + rope (Mistral 4, dots3)."""
    hidden, heads = fields.get("hidden_size"), fields.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(fields.get("attention_hidden_size"), int):
        tiny["attention_hidden_size"] = fields["attention_hidden_size"] * _HIDDEN // hidden
        if isinstance(heads, int) and isinstance(fields.get("attention_head_dim"), int):
            tiny["attention_head_dim"] = tiny["attention_hidden_size"] // _HEADS
    rope, nope, head_dim = (fields.get(k) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "head_dim"))
    if isinstance(rope, int) and isinstance(nope, int) and isinstance(head_dim, int):
        tiny["head_dim"] = 2 * _HEAD_DIM if head_dim == rope + nope else _HEAD_DIM


def _declared_none(config_class: type) -> set[str]:
    """Fields the config class declares with default None (derived in `__post_init__` when not given)."""
    import dataclasses
    import inspect

    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class) if f.default is None}
    return {name for name, p in inspect.signature(config_class.__init__).parameters.items() if p.default is None}


def _tiny_layers(fields: dict, tiny: dict, per_layer_config: dict) -> None:
    """Layer counts, per-layer lists and per-layer configs on the kept layers (`_kept_layers`)."""
    count_field = next((f for f in _LAYER_COUNTS if isinstance(fields.get(f), int)), None)
    if count_field is None:
        return
    layers = fields[count_field]
    per_layer = {k: v for k, v in fields.items() if isinstance(v, list) and len(v) == layers and layers > 1}
    overrides = {int(k): v for k, v in per_layer_config.items()}
    keep = _kept_layers(layers, per_layer, overrides)
    for f in _LAYER_COUNTS + _ENCODER_LAYER_COUNTS:
        if isinstance(fields.get(f), int):
            tiny[f] = len(keep)
    for name, values in per_layer.items():
        tiny[name] = [_tiny_per_layer(name, values[i]) for i in keep]
    for name in _LAYER_INDICES:
        if isinstance(fields.get(name), list):
            tiny[name] = [keep.index(i) for i in fields[name] if i in keep]
    if overrides:
        tiny["per_layer_config"] = {new: {k: _tiny_override(k, v, fields) for k, v in overrides[old].items()}
                                    for new, old in enumerate(keep) if old in overrides}
    _tiny_periods(fields, tiny, layers, len(keep))


def _kept_layers(layers: int, per_layer: dict[str, list], overrides: dict[int, dict]) -> list[int]:
    """Indices of FAMILY_LAYERS layers (more only where the model has more than FAMILY_LAYERS distinct kinds): the
    first layer of each distinct kind (its per-layer list entries and per-layer overrides), then a second of each
    (layers sharing weights by kind, Zamba's, need two), then the earliest others; in order. The kind the default
    model ends on ends the tiny one too (Gemma forces a full-attention last layer)."""
    def kind(i: int) -> str:
        return repr(([values[i] for values in per_layer.values()], overrides.get(i)))

    by_kind: dict[str, list[int]] = {}
    for i in range(layers):
        by_kind.setdefault(kind(i), []).append(i)
    keep = {indices[0] for indices in by_kind.values()}
    last = by_kind[kind(layers - 1)]
    if max(keep) != layers - 1 and kind(max(keep)) != kind(layers - 1):
        keep.discard(last[0])
        keep.add(last[-1])
    wanted = max(min(FAMILY_LAYERS, layers), len(keep))
    for second in (indices[1] for indices in by_kind.values() if len(indices) > 1):
        if len(keep) < wanted:
            keep.add(second if second not in keep else next(i for i in range(layers) if i not in keep))
    for i in range(layers):
        if len(keep) >= wanted:
            break
        keep.add(i)
    return sorted(keep)


def _tiny_per_layer(name: str, value):
    """One layer's entry of a per-layer list (a size list shrinks like its field)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    if name == "num_attention_heads_per_layer":
        return _HEADS
    if name == "intermediate_size":
        return _FFN
    return value


def _tiny_override(name: str, value, fields: dict):
    """A per-layer override of a size field: the tiny size, doubled or halved as the layer's differs from the
    model's (Gemma 4's full-attention layers: head_dim 512 over 256 becomes 32 over 16)."""
    if name not in _SIZE_RULES and name not in _KV_HEADS or not isinstance(value, int):
        return value
    base = fields.get(name)
    tiny = _HEADS if name in _KV_HEADS else _SIZE_RULES[name]
    tiny = tiny(base) if callable(tiny) else tiny
    if not isinstance(base, int) or value == base:
        return tiny
    return tiny * 2 if value > base else max(1, tiny // 2)


def _tiny_periods(fields: dict, tiny: dict, default_layers: int, layers: int) -> None:
    """Fields placing kinds of layers by period, offset or count, fitted to `layers` layers so that each kind
    still occurs (Jamba's attention every 8th layer from the 4th: every 2nd from the 1st)."""
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or name in tiny and tiny[name] != value:
            continue
        if value == default_layers and name not in _LAYER_COUNTS:  # every layer (an assistant sharing all its KV)
            tiny[name] = layers
        elif name.endswith(("_period", "_interval", "_step", "every_n_layers", "_pattern", "group_size")):
            tiny[name] = min(value, 2)
        elif name.endswith("_offset") or name in ("first_k_dense_replace", "num_dense_layers",
                                                   "moe_layer_start_index", "loop_layer_index_start"):
            tiny[name] = min(value, 1)
        elif name in ("moe_layer_end_index", "loop_layer_index_end", "max_window_layers"):
            tiny[name] = min(value, layers - 1)
        elif name in ("num_kv_shared_layers", "num_nextn_predict_layers", "n_layers_per_attn_res_block"):
            tiny[name] = min(value, layers // 2)


def build_registry_model(model_type: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Save a random-weight bf16 tiny model of `model_type` (through its causal-LM class) with the canary
    tokenizer."""
    from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = build_model(model_type, tiny_config(model_type)).to(torch.bfloat16)
    model.save_pretrained(str(out))
    save_tokenizer(out)
    (out / RANDOM_WEIGHTS_MARKER).write_text(f"random weights, seed {seed}: outputs are noise\n")
    return out


