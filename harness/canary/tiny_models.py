"""Tiny random-weight models of the three architecture families, built from transformers configs.

They prove the plumbing (tests, and the default run before trained canaries exist); their outputs are
noise, and every run that uses one says so.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.canary.tokenizer import VOCAB_SIZE, save_tokenizer

ARCHS = ("gqa", "mla", "hybrid")
RANDOM_WEIGHTS_MARKER = "RANDOM_WEIGHTS"  # file beside the weights: this model was never trained


def tiny_config(arch: str):
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  max_position_embeddings=4096, bos_token_id=None, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    if arch == "gqa":
        from transformers import LlamaConfig

        return LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, **common)
    if arch == "mla":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                                qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, n_group=1, topk_group=1, **common)
    if arch == "hybrid":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                               linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                               linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32, **common)
    raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHS)}")


def build_tiny_model(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Save a random-weight bf16 model of `arch` with the character tokenizer to `out_dir`."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).to(torch.bfloat16)
    model.save_pretrained(str(out))
    save_tokenizer(out)
    (out / RANDOM_WEIGHTS_MARKER).write_text(f"random weights, seed {seed}: outputs are noise\n")
    return out


# -- model families (tests/test_families.py): one tiny random-weight model per transformers family -----------
# hidden 64, 4 layers, 4 query heads of 16 dims (2 KV heads), the canary tokenizer. Each hybrid places at least
# one attention layer among its linear/SSM layers; each sliding-window family a window (16 tokens) shorter than
# the test's prompts, so the window is really applied; MoE families 4 experts of 32 dims, 2 per token.
FAMILY_LAYERS = 4
_WINDOW = 16
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
            num_key_value_heads=4)
_SLIDING_FULL = ["sliding_attention", "full_attention"] * (FAMILY_LAYERS // 2)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
               mamba_expand=2, mamba_chunk_size=16)

# family name -> (transformers model_type, config overrides beyond the common tiny settings)
FAMILIES: dict[str, tuple[str, dict]] = {
    "apertus": ("apertus", {}),
    "cohere2": ("cohere2", dict(sliding_window=_WINDOW, layer_types=_SLIDING_FULL)),
    "deepseek_v2": ("deepseek_v2", dict(_MLA, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                                        n_group=1, topk_group=1, **_MOE)),
    "deepseek_v3": ("deepseek_v3", dict(_MLA, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                                        n_group=1, topk_group=1, **_MOE)),
    "ernie4_5": ("ernie4_5", {}),
    "exaone4": ("exaone4", dict(sliding_window=_WINDOW, layer_types=_SLIDING_FULL)),
    "falcon_h1": ("falcon_h1", dict(_MAMBA2, mamba_d_ssm=128)),
    "gemma2": ("gemma2", dict(sliding_window=_WINDOW, layer_types=_SLIDING_FULL, query_pre_attn_scalar=16)),
    "gemma3_text": ("gemma3_text", dict(sliding_window=_WINDOW, layer_types=_SLIDING_FULL, query_pre_attn_scalar=16)),
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                  topk_group=1, **_MOE)),
    "glm4_moe_lite": ("glm4_moe_lite", dict(_MLA, n_routed_experts=4, n_shared_experts=1,
                                            mlp_layer_types=["dense"] + ["sparse"] * (FAMILY_LAYERS - 1), **_MOE)),
    "gpt_oss": ("gpt_oss", dict(sliding_window=_WINDOW, layer_types=_SLIDING_FULL, num_local_experts=4,
                                num_experts_per_tok=2)),
    "lfm2": ("lfm2", dict(layer_types=["conv", "full_attention"] * (FAMILY_LAYERS // 2), full_attn_idxs=None,
                          block_auto_adjust_ff_dim=False)),
    "llama": ("llama", {}),
    "llama4_text": ("llama4_text", dict(attention_chunk_size=_WINDOW, num_local_experts=4, num_experts_per_tok=1,
                                        intermediate_size_mlp=128, no_rope_layers=[1, 1, 1, 0],
                                        layer_types=["chunked_attention"] * 3 + ["full_attention"])),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral_sliding": ("mistral", dict(sliding_window=_WINDOW)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "nemotron_h": ("nemotron_h", dict(layers_block_type=["mamba", "attention", "mamba", "mlp"],
                                      ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=32, n_groups=1,
                                      chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)),
    "olmo2": ("olmo2", {}),
    "phi3": ("phi3", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, **_MOE)),
    "qwen3_next": ("qwen3_next", dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                      linear_value_head_dim=16, num_experts=4, shared_expert_intermediate_size=32,
                                      **_MOE)),
    "seed_oss": ("seed_oss", {}),
    "smollm3": ("smollm3", {}),
    # hybrids with their attention layers placed among the linear / SSM layers
    "jamba": ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                            num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                            mamba_dt_rank=8, use_mamba_kernels=False)),
    "bamba": ("bamba", dict(_MAMBA2, attn_layer_indices=[1, 3])),
    "granitemoehybrid": ("granitemoehybrid", dict(_MAMBA2, num_local_experts=4, num_experts_per_tok=2,
                                                  layer_types=["mamba", "attention"] * (FAMILY_LAYERS // 2))),
    "kimi_linear": ("kimi_linear", dict(_MLA, q_lora_rank=None, num_experts=4, num_experts_per_token=2,
                                        moe_intermediate_size=32, num_shared_experts=1, linear_head_dim=16,
                                        linear_num_heads=4, mlp_layer_types=["dense"] + ["sparse"] * 3,
                                        layer_types=["linear_attention", "full_attention"] * 2)),
    "minimax": ("minimax", dict(num_local_experts=4, num_experts_per_tok=2, block_size=16,
                                layer_types=["linear_attention", "full_attention"] * 2)),
}
ISSUE_FAMILIES = tuple(FAMILIES)  # the 32 of issue 26 (mistral twice: without and with a window)
# further decoder-only causal LM families transformers ships with a KV cache, each built and generating at these
# settings on transformers 5.24 (dots1 and zamba2 did not build from these settings and are not listed)
FAMILIES.update({
    "arcee": ("arcee", {}),
    "cohere": ("cohere", {}),
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32)),
    "exaone": ("exaone", {}),
    "gemma": ("gemma", {}),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "gpt_neox": ("gpt_neox", {}),
    "granite": ("granite", {}),
    "granitemoe": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2)),
    "helium": ("helium", {}),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
    "internlm3": ("internlm3", {}),
    "lfm2_moe": ("lfm2_moe", dict(layer_types=["conv", "full_attention"] * (FAMILY_LAYERS // 2), num_experts=4,
                                  num_dense_layers=1, **_MOE)),
    "minimax_m2": ("minimax_m2", dict(num_local_experts=4, num_experts_per_tok=2)),
    "ministral": ("ministral", dict(sliding_window=_WINDOW, layer_types=_SLIDING_FULL)),
    "nemotron": ("nemotron", {}),
    "olmo": ("olmo", {}),
    "olmo3": ("olmo3", dict(sliding_window=_WINDOW, layer_types=_SLIDING_FULL)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
    "phi": ("phi", {}),
    "phimoe": ("phimoe", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, shared_expert_intermediate_size=32, **_MOE)),
    "stablelm": ("stablelm", {}),
    "starcoder2": ("starcoder2", {}),
})


def family_config(family: str):
    """The tiny config of `family` (a key of FAMILIES); KeyError names the known ones."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    model_type, overrides = FAMILIES[family]
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_hidden_layers=FAMILY_LAYERS, max_position_embeddings=4096,
                  bos_token_id=None, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, **{**common, **overrides})


def build_family_model(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Save a random-weight bf16 model of a transformers family (FAMILIES) with the canary tokenizer."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family)).to(torch.bfloat16)
    model.save_pretrained(str(out))
    save_tokenizer(out)
    (out / RANDOM_WEIGHTS_MARKER).write_text(f"random weights, seed {seed}: outputs are noise\n")
    return out
