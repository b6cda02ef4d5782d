"""Who watches our kernels' launches: a recorder that splits a forward pass by GPU (harness/replay/segments.py) sees
aten ops through a dispatch mode, but a Triton or NVRTC launch is not an aten op. Every launcher of ours says the
device it launches on (`launching`), so a pass recorded as one CUDA graph per GPU starts the launch's GPU's graph
first, as it does for an op. No dependency: kernels/nvrtc.py and kernels/splits.py both import it."""

from __future__ import annotations

import contextvars

# the watcher of the current thread or task (a recorder's), None: nobody watches
LAUNCH_WATCHER: contextvars.ContextVar = contextvars.ContextVar("kernels_launch_watcher", default=None)


def launching(device) -> None:
    """A launcher of ours is about to launch on `device` (a torch.device)."""
    watcher = LAUNCH_WATCHER.get()
    if watcher is not None:
        watcher(device)
