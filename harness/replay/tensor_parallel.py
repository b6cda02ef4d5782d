"""One model over several GPUs of a host by tensor parallelism: a process per GPU (`torch.distributed`, NCCL on
GPUs, gloo on the CPU), each holding its slice of every layer as transformers' tensor-parallel plan
(`base_model_tp_plan`, `DistributedConfig(tp_size=N)`) cuts it.

Every rank replays the same units in lockstep: the plan gathers the LM head's output, so every rank holds the
full logits and takes the same greedy token; only rank 0 writes the run directory (the others write into a
private copy of it, which keeps their resume state and reads identical and is deleted at the end). Batched, every
rank runs the same batches: each choice that shapes a collective is made alike (the auto batch size from the least
free memory over the ranks, `min_across_ranks`; rows leave at EOS by the gathered logits), and what one rank
cannot decide alone (an out-of-memory halving) ends the run instead (`runner.in_lockstep`); batches decode
dynamically (`route.TENSOR_DECODE`).

What the FP8 KV paths need beyond the plan:
- each rank's attention layers see their local KV heads (heads `rank*H/N ... (rank+1)*H/N - 1`: the colwise
  k/v projections are cut in contiguous blocks), so the FP8 cache layers, their write statistics and the Triton
  decode kernels are per rank and per local head;
- calibration amax is reduced across ranks before any scale is made from it (`gather_head_amax`: per-head amax
  gathered into the full [H] vector, query amax max-reduced), so the scales a path uses, per tensor or per head,
  are those a one-GPU run computes, and the manifest stores those;
- a per-head scale vector (calibrated, or read from a checkpoint) is cut to the rank's heads when its cache is
  built (`local_scales`).

Random-weight stand-ins without weight files are made whole on every rank's device from the same seed (so every
rank starts from the same weights, bit for bit where the ranks' devices are of one kind) and then cut by the plan:
the model must fit one device while it is made.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from harness.replay.route import TENSOR_DECODE
from harness.replay.sharding import ShardError

NO_PLAN = ("{family}: transformers has no tensor-parallel plan (base_model_tp_plan) for this family; "
           "use --shard layers (layer sharding works for every family)")


def free_port() -> int:
    """A TCP port free on this host now, for the ranks' rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_world(device: str) -> list[str]:
    """The ranks' devices of `--device` for `--shard tensor`: `cuda:0,1` (or `cuda:0,cuda:1`) -> [cuda:0, cuda:1];
    `cpu,cpu` (N times) -> N CPU ranks (gloo: tests and machines without GPUs) (`devices.device_list`)."""
    from harness.replay.devices import device_list

    return device_list(device)


def refusal(config, world: int) -> str | None:
    """Why this model cannot run at tensor-parallel size `world` (None: it can), from its config alone."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = getattr(text, "model_type", type(config).__name__)
    if not getattr(text, "base_model_tp_plan", None):
        return NO_PLAN.format(family=family)
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if heads and heads % world:
            return (f"{family}: {name} = {heads} does not split over {world} ranks (the plan cuts heads in equal "
                    f"blocks); use a tensor-parallel size that divides it, or --shard layers")
    return None


# ---------------------------------------------------------------- ranks that torchrun started (several hosts)

# what torchrun sets for each process it starts (`torch.distributed.run`): the rendezvous of `init_process_group`,
# and its elastic agent's run id (the ranks `init_rank` starts set the others, not that one)
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def torchrun_launch() -> tuple[int, int, int] | None:
    """(global rank, local rank, world size) of a process that `torchrun` started (its environment), else None."""
    if not all(os.environ.get(name) for name in TORCHRUN_ENV):
        return None
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def torchrun_devices(device: str) -> list[str]:
    """Every global rank's device under torchrun, for `--device cpu` (gloo ranks) or `--device cuda` (each rank its
    host's GPU LOCAL_RANK; ranks of another host named `node<i>/cuda:<j>`, so no GPU reads as named twice)."""
    _, _, size = torchrun_launch()
    if device == "cpu":
        return ["cpu"] * size
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE") or size)
    return [f"cuda:{r % per_host}" if r < per_host else f"node{r // per_host}/cuda:{r % per_host}"
            for r in range(size)]


def torchrun_refusal(device: str, shard: str | None) -> str | None:
    """Why a `harness run` under torchrun cannot run as its ranks (None: it can)."""
    if shard != "tensor":
        return ("launched by torchrun: only --shard tensor runs as torchrun's ranks (every other run would be "
                "replayed once per process); add --shard tensor, or run harness without torchrun")
    if device not in ("cpu", "cuda"):
        return (f"--device {device} under torchrun: each rank takes its GPU from LOCAL_RANK; give --device cuda (or "
                f"--device cpu for gloo ranks)")
    return None


def init_torchrun_rank(device: str) -> str:
    """This process as the rank torchrun started: the process group from its environment (NCCL on GPUs, gloo on
    the CPU) and, on GPUs, the current device LOCAL_RANK. Returns the rank's device."""
    import torch.distributed as dist

    rank, local, size = torchrun_launch()
    if device == "cpu":
        dist.init_process_group("gloo", rank=rank, world_size=size)
        return "cpu"
    own = f"cuda:{local}"
    torch.cuda.set_device(own)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=torch.device(own))
    return own


def init_rank(rank: int, devices: list[str], port: int) -> None:
    """This process as rank `rank` of len(devices): env as torchrun sets it (transformers reads LOCAL_RANK for the
    rank's GPU), the process group (NCCL on GPUs, gloo on the CPU) and the current CUDA device."""
    import torch.distributed as dist

    device = devices[rank]
    local = int(device.split(":")[1]) if device.startswith("cuda:") else rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(local),
                      WORLD_SIZE=str(len(devices)), LOCAL_WORLD_SIZE=str(len(devices)))
    if device.startswith("cuda:"):
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=len(devices), device_id=torch.device(device))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=len(devices))


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def load(weights: Path, dtype: torch.dtype, attn_implementation: str, random_weights: bool, device: str,
         seed: int = 0) -> torch.nn.Module:
    """This rank's slice of the model of `weights` (a process group of the tensor-parallel size must exist)."""
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    from harness.replay.families import load_model
    from harness.replay.sharding import has_weight_files

    _, size = world()
    config = AutoConfig.from_pretrained(str(weights))
    why = refusal(config, size)
    if why:
        raise ShardError(why)
    distributed = DistributedConfig(tp_size=size)
    if has_weight_files(weights):
        model = load_model(weights, dtype=dtype, attn_implementation=attn_implementation,
                           distributed_config=distributed)
    elif random_weights:
        model = _random_on_rank(config, dtype, attn_implementation, device, seed, distributed)
    else:
        raise FileNotFoundError(f"model directory {weights} has no weight files (and no random-weights marker)")
    return model.eval()


def _random_on_rank(config, dtype, attn_implementation, device, seed, distributed):
    """The whole model made on this rank's device from `seed` (every rank the same weights), then cut by the plan
    (transformers' `maybe_distribute_model`, as `from_pretrained` applies it before loading weights)."""
    from harness.replay.families import causal_lm_class, concrete_class, model_from_config

    cls = concrete_class(causal_lm_class(config), config)  # the class from_config builds
    distributed, _, mesh = cls.prepare_distribute_model(distributed)
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.manual_seed(seed)
    with torch.device(device):
        model = model_from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return cls.maybe_distribute_model(model, distributed, mesh)


# ---------------------------------------------------------------- scales across ranks


def gather_head_amax(cache) -> None:
    """Each observer layer's per-head amax (this rank's KV heads) replaced by the full [H] vector of every rank's
    heads in rank order: the amax a one-GPU run records. No-op outside a process group."""
    import torch.distributed as dist

    _, size = world()
    if size == 1:
        return
    for layer in cache.layers:
        for name in ("k_amax", "v_amax"):
            local = getattr(layer, name, None)
            if local is None:
                continue
            moved = local.float().to(_collective_device()).contiguous()
            gathered = [torch.empty_like(moved) for _ in range(size)]
            dist.all_gather(gathered, moved)
            parts = [g.cpu() for g in gathered]
            setattr(layer, name, torch.cat(parts))


def max_across_ranks(values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """{layer: amax} with each value the max over ranks (query amax: each rank sees its local query heads)."""
    import torch.distributed as dist

    _, size = world()
    if size == 1:
        return values
    out = {}
    for layer in sorted(values):
        value = values[layer].float().to(_collective_device()).clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        out[layer] = value.cpu()
    return out


def min_across_ranks(value: int) -> int:
    """The least of `value` over the ranks (one all_reduce; `value` itself outside a process group): a choice
    every rank must make alike, such as a batch size read from its own free memory."""
    import torch.distributed as dist

    _, size = world()
    if size == 1:
        return value
    least = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return int(least.item())


def local_scales(scales):
    """A LayerScales whose per-head K/V scale vectors are cut to this rank's KV heads (contiguous blocks, rank
    order); per-tensor scales stay as they are."""
    rank, size = world()
    if scales is None or size == 1:
        return scales

    def cut(table: dict) -> dict:
        return {i: (s.reshape(size, -1)[rank].clone() if s.numel() > 1 else s) for i, s in table.items()}

    return dataclasses.replace(scales, k=cut(scales.k), v=cut(scales.v))


def _on_cpu_group() -> bool:
    import torch.distributed as dist

    return dist.get_backend() == "gloo"


def _collective_device() -> torch.device:
    return torch.device("cpu") if _on_cpu_group() else torch.device("cuda", torch.cuda.current_device())


# What every rank does alike in a batched tensor-parallel run (`manifest.parallel.batch_composition`)
IN_LOCKSTEP_BATCHES = (f"batched, every rank the same batches in lockstep (the same waves and order; auto batch size "
                       f"from the least free memory over the ranks; rows leave at EOS by the gathered logits, alike "
                       f"on every rank; an out-of-memory error or a failed batch ends the run, resumable, instead of "
                       f"a batch of one rank's own); dynamic decode (static and graph decode refused: "
                       f"{TENSOR_DECODE})")
ONE_AT_A_TIME_RANKS = "one sequence at a time (CPU ranks without --batch-size, as on one CPU)"


def layout(devices: list[str], models: dict[str, dict], batched: bool = True, torchrun: bool = False) -> dict:
    """`manifest.parallel` of a tensor-parallel run (batched: the run replays in batches, `RunConfig.batched`;
    torchrun: its ranks were started by torchrun, on this host or several)."""
    return {"kind": "tensor-parallel", "world_size": len(devices), "devices": list(devices),
            "backend": "gloo" if devices[0] == "cpu" else "nccl", "models": models,
            "launcher": "torchrun (global rank 0 runs the job)" if torchrun else "harness (a process per device)",
            "writer": "rank 0 (every rank replays every unit in lockstep)",
            "batch_composition": IN_LOCKSTEP_BATCHES if batched else ONE_AT_A_TIME_RANKS,
            "noise": "reductions split over ranks change bf16 rounding: tokens and log-probs may differ from a "
                     "one-GPU run by the floor tests/test_tensor_parallel.py measures"}


def describe_model(model: torch.nn.Module, size: int) -> dict:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    return {"plan": "transformers base_model_tp_plan", "heads_per_rank": heads // size if heads else None,
            "kv_heads_per_rank": kv_heads // size if kv_heads else None}
