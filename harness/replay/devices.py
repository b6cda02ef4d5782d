"""`--device` read once: what a user typed resolved against the host, and the devices a resolved spec names.

`resolve_device` checks the spec (`cpu`, `auto`, `cuda`, `cuda:N`, `cuda:N,M,...`, `cuda:all`, and `cpu,cpu,...` for
the gloo ranks of `--shard tensor` in tests) and `device_list` is the one reader of a resolved spec: the data-parallel
pool, layer sharding and tensor-parallel ranks all take their devices from it.
"""

from __future__ import annotations

import re

import torch

GPU_LIST = re.compile(r"cuda:\d+(,(cuda:)?\d+)+")  # cuda:0,1 or cuda:0,cuda:1 (what rank processes get)
CPU_RANKS = re.compile(r"cpu(,cpu)+")  # gloo CPU ranks of --shard tensor (tests; RunConfig checks the pair)


def resolve_device(device: str) -> str:
    """`cpu`, `auto`, `cuda`, `cuda:N`, or several GPUs of this host for a data-parallel run: `cuda:0,1,3` or
    `cuda:all` (returned as the list, e.g. `cuda:0,1`); anything else is refused before a model loads."""
    if CPU_RANKS.fullmatch(device):
        return device
    if device not in ("cpu", "auto", "cuda", "cuda:all") and not re.fullmatch(r"cuda:\d+(,\d+)*", device):
        raise ValueError(f"--device {device}: unknown device; expected cpu, cuda, cuda:N, cuda:N,M,..., cuda:all "
                         f"or auto")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device (torch {torch.__version__})")
    count = torch.cuda.device_count()
    if device == "cuda:all":
        return "cuda" if count == 1 else "cuda:" + ",".join(map(str, range(count)))
    if device.startswith("cuda:"):
        indices = [int(i) for i in device[5:].split(",")]
        if max(indices) >= count:
            raise ValueError(f"--device {device}: torch sees {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
        if len(set(indices)) != len(indices):
            raise ValueError(f"--device {device}: a GPU is named twice")
    return device


def device_list(device: str) -> list[str]:
    """The devices of a resolved --device: `cuda:0,1` (or `cuda:0,cuda:1`) -> [cuda:0, cuda:1]; `cpu,cpu` -> two
    CPU ranks; one device -> [it]."""
    if GPU_LIST.fullmatch(device):
        return [part if part.startswith("cuda:") else f"cuda:{part}" for part in device[5:].split(",")]
    if CPU_RANKS.fullmatch(device):
        return device.split(",")
    return [device]
