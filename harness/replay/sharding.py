"""One model over several GPUs of a host in one process: its decoder layers split in contiguous blocks
(pipeline-style layer sharding), placed by accelerate's `dispatch_model` / transformers' `device_map`.

Every family works: the plan only names modules (`model.embed_tokens`, `model.layers.N`, `model.norm`,
`lm_head`, `model.rotary_emb`, whatever else sits at the top of the model), and accelerate's hooks move each
layer's inputs to that layer's GPU. A layer's KV cache, its FP8 copy, its write statistics, its calibration amax
and its Triton decode kernel then live on the layer's GPU (the cache layers are created from the K/V they are
given; the kernel launchers run on their tensors' device).

A model directory with a `config.json`, a tokenizer and the random-weights marker but no weight files (a
70B-shaped stand-in, say: 140 GB of random weights are not worth writing to disk) is built on the meta device
and each tensor is created directly on its GPU, seeded, never on the CPU.

The parallel layout a run stores (`manifest.parallel`) comes from `describe`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.replay.devices import device_list
from harness.replay.route import LAYERS_GRAPH

SHARD_MODES = ("layers", "tensor")  # --shard values; tensor: harness.replay.tensor_parallel (a process per GPU)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class ShardError(ValueError):
    """A --shard request that cannot run (said before any model loads)."""


def check_devices(devices: list[str]) -> None:
    """The devices of `--shard tensor`: two or more GPUs (or CPU ranks, for tests), none named twice."""
    gpus = [d.split("/")[-1] for d in devices]  # torchrun's ranks on other hosts: node<i>/cuda:<j>
    if len(devices) < 2 or not (all(d.startswith("cuda:") for d in gpus) or all(d == "cpu" for d in devices)):
        named = ",".join(devices)
        raise ShardError(f"--shard tensor runs a process per GPU, but --device resolved to {named}: name the GPUs, "
                         f"e.g. --device cuda:0,1 or cuda:all on a host with several GPUs (cpu,cpu: two CPU ranks "
                         f"over gloo, for tests)")
    if len(set(devices)) != len(devices) and devices[0] != "cpu":
        raise ShardError(f"--shard tensor: --device names a GPU twice ({','.join(devices)})")


def check_shard(shard: str | None, devices: list[str]) -> None:
    """Refuse a --shard value or device list that cannot shard a model (a ShardError naming the flag)."""
    if shard is None:
        return
    if shard == "tensor":
        check_devices(devices)
        return
    if shard not in SHARD_MODES:
        raise ShardError(f"--shard {shard}: unknown; expected one of {', '.join(SHARD_MODES)}")
    if len(devices) < 2 or not all(d.startswith("cuda:") for d in devices):
        named = ",".join(devices)
        raise ShardError(f"--shard {shard} splits one model over several GPUs, but --device resolved to {named}: "
                         f"name them, e.g. --device cuda:0,1 or cuda:all on a host with several GPUs")


def split_devices(device: str) -> list[str]:
    """`cuda:0,1` -> [cuda:0, cuda:1]; one device -> [it] (`devices.device_list`, the one reader of a spec)."""
    return device_list(device)


def layer_blocks(num_layers: int, devices: list[str]) -> list[range]:
    """Contiguous decoder-layer blocks, one per device, sizes as equal as possible (the first devices take the
    remainder). A device gets none when there are more devices than layers."""
    if not devices:
        raise ShardError("no devices to shard over")
    base, extra = divmod(num_layers, len(devices))
    blocks, start = [], 0
    for i in range(len(devices)):
        size = base + (1 if i < extra else 0)
        blocks.append(range(start, start + size))
        start += size
    return blocks


@dataclass(frozen=True)
class ShardPlan:
    """Which GPU holds which module: `device_map` as transformers / accelerate take it."""

    devices: tuple[str, ...]
    num_layers: int
    layers_prefix: str  # "model.layers" (the decoder's ModuleList, as named in the model)
    blocks: tuple[range, ...]
    device_map: dict

    def layer_device(self, index: int) -> str:
        return next(d for d, block in zip(self.devices, self.blocks) if index in block)

    def describe(self) -> dict:
        """The layout as the manifest keeps it."""
        def span(block: range) -> str:
            return "none" if not block else (f"{block.start}" if len(block) == 1 else f"{block.start}-{block.stop - 1}")

        others = {name: dev for name, dev in self.device_map.items() if not name.startswith(self.layers_prefix + ".")}
        return {"layers": {d: span(b) for d, b in zip(self.devices, self.blocks)}, "num_layers": self.num_layers,
                "other_modules": {name: _device_name(dev) for name, dev in sorted(others.items())}}


def _device_name(device) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def plan_for(model: torch.nn.Module, devices: list[str]) -> ShardPlan:
    """The plan for a built (possibly meta) model: its decoder layers in blocks over `devices`, every other
    top-level module on the GPU its neighbours in the forward pass are on (embeddings, rotary tables and anything
    before the layers on the first GPU; the final norm and the LM head on the last)."""
    prefix, layers = _decoder_layers(model)
    blocks = layer_blocks(len(layers), devices)
    first, last = devices[0], devices[-1]
    device_map: dict = {}
    for name, _ in _top_modules(model, prefix):
        device_map[name] = last if re.search(r"(^|\.)(norm|final_layernorm|ln_f|lm_head)$", name) else first
    for block, device in zip(blocks, devices):
        for i in block:
            device_map[f"{prefix}.{i}"] = device
    # the first GPU's modules first: accelerate takes the map's first device as the model's own, where its hook
    # moves the inputs (the LM head, named first at the model's root, had put them on the last GPU and back)
    device_map = dict(sorted(device_map.items(), key=lambda item: item[1] != first))
    return ShardPlan(tuple(devices), len(layers), prefix, tuple(blocks), device_map)


def _decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder's layer list: the ModuleList named `*.layers` (every family here), else the longest one."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    named = [(n, m) for n, m in lists if n.split(".")[-1] in ("layers", "h", "blocks")]
    if not (named or lists):
        raise ShardError(f"{type(model).__name__}: no decoder layer list found to shard")
    return max(named or lists, key=lambda item: len(item[1]))


def _top_modules(model: torch.nn.Module, prefix: str) -> list[tuple[str, torch.nn.Module]]:
    """The modules beside the layer list on its way from the root (e.g. model.embed_tokens, model.rotary_emb,
    model.norm, lm_head): every child of an ancestor of the layer list that is not itself such an ancestor and
    holds parameters or buffers."""
    parts = prefix.split(".")
    ancestors = [".".join(parts[:i]) for i in range(len(parts))]  # "", "model" for "model.layers"
    found = []
    for ancestor in ancestors:
        module = model.get_submodule(ancestor) if ancestor else model
        if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            raise ShardError(f"{type(model).__name__}: {ancestor or 'the model'} holds tensors of its own beside its "
                             f"layers; layer sharding does not know where they go")
        for child, sub in module.named_children():
            full = f"{ancestor}.{child}" if ancestor else child
            if full not in ancestors and full != prefix and _holds_tensors(sub):
                found.append((full, sub))
    return found


def _holds_tensors(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def has_weight_files(directory: Path) -> bool:
    return any(f.suffix in WEIGHT_SUFFIXES for f in Path(directory).iterdir() if f.is_file())


def load_sharded(weights: Path, devices: list[str], dtype: torch.dtype, attn_implementation: str,
                 random_weights: bool, seed: int = 0) -> tuple[torch.nn.Module, ShardPlan]:
    """The model of `weights`, its layers over `devices` (ShardPlan). A directory with weight files loads them
    straight onto each module's GPU (transformers' `device_map`); a random-weights directory without them is built
    on the meta device and initialised on the GPUs."""
    from transformers import AutoConfig

    from harness.replay.families import load_model, model_from_config

    _need_accelerate()
    config = AutoConfig.from_pretrained(str(weights))
    with torch.device("meta"):
        skeleton = model_from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    plan = plan_for(skeleton, devices)
    if has_weight_files(weights):
        del skeleton
        model = load_model(weights, dtype=dtype, attn_implementation=attn_implementation,
                           device_map=dict(plan.device_map))
    elif random_weights:
        model = _random_on_devices(config, plan, dtype, attn_implementation, seed)
    else:
        raise FileNotFoundError(f"model directory {weights} has no weight files (and no random-weights marker)")
    return model.eval(), plan


def _random_on_devices(config, plan: ShardPlan, dtype: torch.dtype, attn_implementation: str, seed: int):
    """Random weights created on each module's GPU: parameters start on the meta device (accelerate's
    `init_empty_weights`; buffers such as the rotary tables are computed as usual), each one is then made on its
    GPU (normal(0, initializer_range) for matrices, ones for norm weights, zeros for biases), and
    `dispatch_model` places the buffers and adds the hooks that move activations between GPUs."""
    from accelerate import dispatch_model, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    from harness.replay.families import model_from_config

    with init_empty_weights(include_buffers=False):
        model = model_from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    std = float(getattr(config, "initializer_range", 0.02))
    generators: dict[str, torch.Generator] = {}
    for name, param in list(model.named_parameters()):
        device = _module_device(plan.device_map, name)
        gen = generators.get(device)
        if gen is None:
            gen = generators[device] = torch.Generator(device=device).manual_seed(seed + len(generators))
        if name.endswith("bias"):
            value = torch.zeros(param.shape, dtype=dtype, device=device)
        elif param.dim() == 1:  # norm weights (RMSNorm / LayerNorm scale)
            value = torch.ones(param.shape, dtype=dtype, device=device)
        else:
            value = torch.empty(param.shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
        set_module_tensor_to_device(model, name, device, value=value)
    model.tie_weights()
    return dispatch_model(model, device_map=dict(plan.device_map))


def _module_device(device_map: dict, tensor_name: str) -> str:
    parts = tensor_name.split(".")
    for i in range(len(parts), 0, -1):
        found = device_map.get(".".join(parts[:i]))
        if found is not None:
            return _device_name(found)
    raise ShardError(f"{tensor_name}: no device in the shard plan")


def _need_accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise ShardError("--shard layers places the model with accelerate's device_map machinery: "
                         "pip install accelerate (or pip install 'fp8-harness[multigpu]')") from None


def layout(plans: dict[str, ShardPlan]) -> dict:
    """`manifest.parallel` of a layer-sharded run: each model's layer blocks per GPU."""
    devices = next(iter(plans.values())).devices if plans else ()
    return {"kind": "layer-sharded", "devices": list(devices),
            "models": {label: plan.describe() for label, plan in plans.items()},
            "batch_composition": f"batched; graph decode records {LAYERS_GRAPH}"}
