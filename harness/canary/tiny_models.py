"""Tiny random-weight models of the three architecture families, built from transformers configs.

They prove the plumbing (tests, and the default run before trained canaries exist); their outputs are
noise, and every run that uses one says so. A tiny model of every family transformers ships is
`harness/canary/registry.py`'s.
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
