"""Where KV scales come from: calibration prompts, a checkpoint's tensors, or a dummy warm-up pass."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from harness.model_layers import layer_count
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
    """Every `*k_scale` / `*v_scale` tensor in the directory's safetensors files (or in one scales file,
    `.safetensors` or quantization-param `.json`, when given a file)."""
    from safetensors import safe_open

    if Path(model_dir).is_file():
        return read_scale_file(Path(model_dir))
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name.endswith(SCALE_NAMES):
                    found[name] = handle.get_tensor(name)
    return found


def dummy_warmup_ids(tokenizer) -> list[int]:
    ids = tokenizer(DUMMY_WARMUP_TEXT, add_special_tokens=False)["input_ids"]
    return (ids * DUMMY_WARMUP_TOKENS)[:DUMMY_WARMUP_TOKENS]


@contextlib.contextmanager
def query_amax(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Record the running amax of the (post-RoPE) query of every attention layer while entered:
    {layer: 0-d fp32 tensor}, the statistic a calibrated q_scale is made from."""
    from harness.forward_context import forward_context

    found: dict[int, torch.Tensor] = {}

    def observe(module, query, key, value, output):
        amax = query.detach().float().abs().amax().cpu()
        layer = int(module.layer_idx)
        found[layer] = amax if layer not in found else torch.maximum(found[layer], amax)

    with forward_context(observe=observe):  # every model call entered inside inherits it
        yield found


def attention_scales_from_checkpoint(tensors: dict[str, torch.Tensor], layers: list[int], where: str,
                                     names: tuple[str, ...]) -> dict[str, dict[int, torch.Tensor]]:
    """q_scale / prob_scale per attention layer from `*.layers.N.*.q_scale` tensors (max over elements)."""
    found: dict[str, dict[int, torch.Tensor]] = {name: {} for name in names}
    for key, value in tensors.items():
        parts = key.split(".")
        if parts[-1] in names and "layers" in parts:
            found[parts[-1]][int(parts[parts.index("layers") + 1])] = value.float().max().reshape(())
    for name in names:
        missing = [i for i in layers if i not in found[name]]
        if missing:
            raise ValueError(f"checkpoint {where} has no {name} for attention layers {missing} "
                             f"(looked for '*.layers.N.*.{name}')")
    return found


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


# ---------------------------------------------------------------- scale files engines load
# safetensors: `model.layers.N.self_attn.k_scale` / `v_scale` (and `q_scale` / `prob_scale` when given),
# float32, shape [] (per tensor; `--scale-shape one` writes [1]) or [num_kv_heads] (per head), value amax / fp8 max:
# the names vLLM and SGLang load beside the weights. JSON: the `--quantization-param-path` file SGLang (and
# older vLLM) read: {"model_type", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {tp rank:
# {layer: scale}}}}, one per-tensor scale per layer for K and V together, every hidden layer listed.

SCALE_NAMES = ("k_scale", "v_scale", "q_scale", "prob_scale")
SAFETENSORS_NAME = "kv_scales.safetensors"
JSON_NAME = "kv_cache_scales.json"


def scale_key(layer: int, name: str) -> str:
    return f"model.layers.{layer}.self_attn.{name}"


def scale_tensors(scales: dict[str, dict[int, torch.Tensor]], shape: str = "scalar") -> dict[str, torch.Tensor]:
    """{name: {layer: scale}} -> {engine key: float32 tensor}. A one-element scale is written with shape []
    (shape="scalar") or [1] (shape="one"); per-head scales keep their [num_kv_heads] shape."""
    if shape not in ("scalar", "one"):
        raise ValueError(f"scale shape {shape!r}: expected 'scalar' ([]) or 'one' ([1])")
    out: dict[str, torch.Tensor] = {}
    for name, per_layer in scales.items():
        if name not in SCALE_NAMES:
            raise ValueError(f"unknown scale name {name!r}; expected one of {', '.join(SCALE_NAMES)}")
        for layer, value in sorted(per_layer.items()):
            value = value.detach().to("cpu", torch.float32).contiguous()
            if value.numel() == 1:
                value = value.reshape(()) if shape == "scalar" else value.reshape(1)
            out[scale_key(layer, name)] = value.clone()
    return out


def quant_param_json(k: dict[int, torch.Tensor], v: dict[int, torch.Tensor], num_hidden_layers: int,
                     model_type: str, fmt: str = "e4m3", tp_size: int = 1) -> dict:
    """SGLang's `--quantization-param-path` JSON: one per-tensor scale per layer (max over K, V and heads);
    layers without a KV cache (linear attention) get 1.0, since the loader wants every hidden layer."""
    if fmt != "e4m3":
        raise ValueError(f"the quantization-param JSON holds float8_e4m3fn scales only, not {fmt}")
    layers = {}
    for layer in range(num_hidden_layers):
        if layer in k and layer in v:
            layers[str(layer)] = float(torch.maximum(k[layer].float().max(), v[layer].float().max()))
        else:
            layers[str(layer)] = 1.0
    return {"model_type": model_type, "kv_cache": {"dtype": "float8_e4m3fn",
                                                   "scaling_factor": {str(r): dict(layers) for r in range(tp_size)}}}


def write_scale_files(out_dir: Path, scales: dict[str, dict[int, torch.Tensor]], config, fmt: str = "e4m3",
                      shape: str = "scalar", metadata: dict | None = None) -> list[Path]:
    """Write `kv_scales.safetensors` (and, for e4m3, `kv_cache_scales.json`) into out_dir."""
    import json

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / SAFETENSORS_NAME]
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    save_file(scale_tensors(scales, shape), str(written[0]), metadata=meta)
    if fmt == "e4m3":
        body = quant_param_json(scales["k_scale"], scales["v_scale"], int(layer_count(config)),
                                str(config.model_type), fmt)
        written.append(out_dir / JSON_NAME)
        written[-1].write_text(json.dumps(body, indent=1) + "\n")
    return written


def read_scale_file(path: Path) -> dict[str, torch.Tensor]:
    """Scale tensors by engine key from a `.safetensors` file or a quantization-param `.json` file (whose
    one scale per layer is used for both K and V). Raises ValueError naming the file when it is neither."""
    import json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"scales file {path} does not exist")
    if path.suffix == ".json":
        try:
            body = json.loads(path.read_text())
            ranks = body["kv_cache"]["scaling_factor"]
            layers = ranks[sorted(ranks, key=int)[0]]
            values = {int(layer): float(value) for layer, value in layers.items()}
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
            raise ValueError(f"scales file {path}: not a quantization-param JSON "
                             f"({{'kv_cache': {{'scaling_factor': {{rank: {{layer: scale}}}}}}}}): {error}") from None
        out = {}
        for layer, value in values.items():
            out[scale_key(layer, "k_scale")] = torch.tensor(value, dtype=torch.float32)
            out[scale_key(layer, "v_scale")] = torch.tensor(value, dtype=torch.float32)
        return out
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys() if name.endswith(SCALE_NAMES)}
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"scales file {path}: not a readable safetensors file ({error})") from None
