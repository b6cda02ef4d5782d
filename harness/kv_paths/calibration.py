"""Where KV scales come from: calibration prompts, a checkpoint's tensors, or a dummy warm-up pass."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from harness.scenarios.filler import filler_text
from harness.types import Message

# Amplitude given to the recurrent layers' output during the emulated warm-up. Uninitialised device
# memory holds arbitrary bit patterns; large Gaussian noise stands in for it, seeded so runs repeat.
UNINITIALISED_STD = 100.0
DUMMY_WARMUP_TOKENS = 64
# Engines feed arbitrary dummy tokens in their warm-up run. We feed a fixed neutral text (not the pad
# token, whose embedding is often zero), so a pure-attention model gets sane scales from it and only an
# uninitialised recurrent state corrupts them, as in the bug report.
DUMMY_WARMUP_TEXT = "warm up the engine "


def default_calibration_chats() -> list[list[Message]]:
    """Generic, in-distribution-for-canaries chats: arithmetic, a planted fact, rules, filler."""
    return [
        [Message("user", "What is 7 * 8 + 3 * 4?")],
        [Message("system", "End every answer with the word Thanks."),
         Message("user", "What plans do you offer?")],
        [Message("user", "Hello, my name is Alexander."), Message("assistant", "Nice to meet you, Alexander."),
         Message("user", "What is my name?")],
        [Message("user", filler_text(600, seed=12345) + "\nWhat is the secret code?")],
    ]


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every `*k_scale` / `*v_scale` tensor in the directory's safetensors files."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name.endswith(("k_scale", "v_scale")):
                    found[name] = handle.get_tensor(name)
    return found


def dummy_warmup_ids(tokenizer) -> list[int]:
    ids = tokenizer(DUMMY_WARMUP_TEXT, add_special_tokens=False)["input_ids"]
    return (ids * DUMMY_WARMUP_TOKENS)[:DUMMY_WARMUP_TOKENS]


@contextlib.contextmanager
def uninitialised_recurrent_state(model: torch.nn.Module, seed: int = 0) -> Iterator[None]:
    """Emulate a warm-up pass whose recurrent (linear-attention) layers read uninitialised state:
    their outputs are replaced by large seeded noise, so the attention layers after them see garbage.
    A model without recurrent layers is untouched (as a pure-attention model is in the bug report)."""
    generator = torch.Generator().manual_seed(seed)

    def garbage(module, inputs, output):
        first = output[0] if isinstance(output, tuple) else output
        noise = torch.randn(first.shape, generator=generator).to(first.dtype).to(first.device) * UNINITIALISED_STD
        return (noise, *output[1:]) if isinstance(output, tuple) else noise

    handles = [module.register_forward_hook(garbage) for name, module in model.named_modules()
               if name.endswith("linear_attn")]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
