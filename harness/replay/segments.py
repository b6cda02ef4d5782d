"""One forward pass of a model laid out over several GPUs (`--shard layers`), recorded as CUDA graphs: one graph for
each run of consecutive work on one GPU, replayed in order.

A torch CUDA graph records one GPU's stream, and torch does not replay a graph whose work spans GPUs (pytorch#153025),
so a layer-sharded decode step cannot be one graph. `SegmentedGraph.record` runs the pass under a dispatch mode that
sees every aten op and the GPU it runs on:
- an op on another GPU than the one being recorded ends that GPU's graph and starts one on the op's GPU (a segment);
- an op that reads a tensor of another GPU (accelerate's hooks moving a layer's inputs, `x.to(other)`) reads a
  *mirror* instead: a tensor of the op's GPU that replay refreshes from the source just before the segment's graph.
  Its memory is not the graphs' pool: replay writes it before the graph runs, so no temporary of the graph may
  share it;
- view ops of aten's own (no kernel, no memory) never start a segment; `to`, `reshape` and `contiguous`, which reach
  the mode undecomposed under inference mode and may copy, are recorded as ops of their device.

Replay copies each segment's mirrors, then launches its graph on its GPU's current stream. torch's cross-GPU copy
orders itself after the source GPU's queued work and before the destination's, so a segment runs after the segments
whose results it reads, and the source GPU does not overwrite a source before it is copied. The rule of the mirror
holds because a segment runs only ops of its own GPU: no other GPU's tensor can change while it runs.

A kernel launched directly (Triton, NVRTC) is not an aten op: our launchers say the GPU they launch on
(`kernels.launches.launching`), which opens its segment as an op does; their inputs are their GPU's tensors, moved
there by aten ops the mode sees. The write statistics count on each GPU
(`cache.KVWriteStats.away`), so a decode step over two GPUs is three segments: the first GPU's layers, the second's
with the norm and LM head, and the first's again (the logits brought back, the step's lengths advanced).
tests/test_multi_gpu.py compares a graph-decoded sharded batch with one GPU's, record for record.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from kernels.launches import LAUNCH_WATCHER


@dataclasses.dataclass
class Segment:
    """One GPU's run of consecutive work: its graph and the (source, mirror) pairs copied before each replay."""

    device: torch.device
    graph: object  # torch.cuda.CUDAGraph, or a test's stand-in with .replay()
    mirrors: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    keys: dict = dataclasses.field(default_factory=dict)  # a source's key -> its mirror, within this segment


class SegmentedGraph:
    """A forward pass recorded as per-GPU CUDA graphs (see the module). `record(fn)` records fn's work and returns
    its result (tensors in the graphs' memory, rewritten by each `replay`)."""

    def __init__(self, begin: Callable[[torch.device], object] | None = None, host: str | None = "cpu"):
        """begin(device) -> a graph whose recording has begun on that device's capture stream, with `.end()` and
        `.replay()` (default: a CUDA graph, `_CudaRecorder`); host: the device type whose ops are not recorded (the
        host's; tests on a CPU machine hand a stand-in recorder and None, recording "cpu" and "meta" segments)."""
        self.segments: list[Segment] = []
        self._begin = begin or _CudaRecorder()
        self.host = host

    def record(self, fn: Callable[[], object]):
        mode = _Segmenter(self)
        watching = LAUNCH_WATCHER.set(mode.launched)
        try:
            with mode:
                result = fn()
        finally:
            LAUNCH_WATCHER.reset(watching)
            mode.close()
        return result

    def replay(self) -> None:
        for segment in self.segments:
            for source, mirror in segment.mirrors:
                mirror.copy_(source, non_blocking=True)
            segment.graph.replay()

    @property
    def devices(self) -> list[str]:
        """The segments' GPUs in order (what the run names)."""
        return [str(segment.device) for segment in self.segments]

    def mirror_count(self) -> int:
        return sum(len(segment.mirrors) for segment in self.segments)


class _CudaRecorder:
    """Graphs of one pass: each GPU's graphs share one memory pool (they replay in the order they were recorded), and
    record on a side stream of their GPU, as `torch.cuda.graph` does (without its synchronize and empty_cache)."""

    def __init__(self):
        self.pools: dict = {}
        self.streams: dict = {}
        self.saved: dict = {}  # device -> the current stream before recording
        self.current_device = torch.cuda.current_device()

    def __call__(self, device: torch.device) -> "_CudaSegmentGraph":
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
            self.saved[device] = torch.cuda.current_stream(device)
        stream = self.streams[device]
        stream.wait_stream(self.saved[device])
        torch.cuda.set_device(device)
        torch.cuda.set_stream(stream)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pools.get(device), capture_error_mode="thread_local")
        return _CudaSegmentGraph(graph, device, self)

    def mirror(self, source: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A mirror's memory, from the device's own stream rather than the graphs' pool: replay writes a mirror before
        its graph runs, so memory the graph itself uses and frees before reading the mirror must not hold it (on two
        H200s a pooled mirror of the write column was overwritten by a temporary of the same graph, session 35)."""
        with torch.cuda.stream(self.saved[device]):
            return torch.empty_like(source, device=device)  # preserve_format: source's strides if dense

    def restore(self) -> None:
        for device, stream in self.saved.items():
            stream.wait_stream(self.streams[device])
            torch.cuda.set_stream(stream)
        torch.cuda.set_device(self.current_device)


class _CudaSegmentGraph:
    def __init__(self, graph: "torch.cuda.CUDAGraph", device: torch.device, recorder: _CudaRecorder):
        self.graph, self.device, self.recorder = graph, device, recorder

    def end(self) -> None:
        self.graph.capture_end()
        self.recorder.pools.setdefault(self.device, self.graph.pool())

    def replay(self) -> None:
        # CUDAGraph.replay launches on the current stream of the current device: its own GPU's
        with torch.cuda.device(self.device):
            self.graph.replay()


@dataclasses.dataclass(frozen=True)
class _OpFacts:
    """What an aten op's schema says of where it runs, read once per op (the mode sees thousands of calls a pass)."""

    device: tuple[int, str] | None  # the `device` argument's (position, name)
    written: tuple[tuple[int, str], ...]  # the arguments it writes (in-place, out=)
    to_other: bool  # `to(other)`: the other tensor's device
    passes: bool  # a view op of aten's own: no kernel, no memory


@functools.lru_cache(maxsize=None)
def _facts(func) -> _OpFacts:
    arguments = list(enumerate(func._schema.arguments))  # noqa: SLF001 - the op's declared arguments and aliasing
    device = next(((i, a.name) for i, a in arguments if a.name == "device"), None)
    written = tuple((i, a.name) for i, a in arguments if a.alias_info is not None and a.alias_info.is_write)
    # `to`, `reshape` and `contiguous` reach the mode undecomposed under inference mode: they may copy, so only
    # views without a CompositeImplicitAutograd kernel pass through
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")  # noqa: SLF001
    return _OpFacts(device, written, func._opname == "to" and func._overloadname == "other",  # noqa: SLF001
                    func.is_view and not composite)


def _argument(args: tuple, kwargs: dict, at: tuple[int, str]):
    return args[at[0]] if at[0] < len(args) else kwargs.get(at[1])


def op_device(func, args: tuple, kwargs: dict, flat: list | None = None) -> torch.device | None:
    """The device an aten op runs on: its `device` argument's (factories, `to`, `_to_copy`), `to(other)`'s other's,
    else the first tensor it writes (in-place and out= ops), else its first tensor's not on the CPU, else its first
    tensor's; None: no tensor. flat: (args, kwargs) flattened, where the caller has it."""
    facts = _facts(func)
    if facts.device is not None:
        value = _argument(args, kwargs, facts.device)
        if value is not None:
            return torch.device(value)
    if facts.to_other:
        return (args[1] if len(args) > 1 else kwargs["other"]).device
    for at in facts.written:
        value = _argument(args, kwargs, at)
        written = value if isinstance(value, torch.Tensor) else next(
            (t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)), None)
        if written is not None:
            return written.device
    first = None
    for t in tree_flatten((args, kwargs))[0] if flat is None else flat:
        if isinstance(t, torch.Tensor):
            if t.device.type != "cpu":
                return t.device
            first = first or t.device
    return first


class _Segmenter(TorchDispatchMode):
    def __init__(self, owner: SegmentedGraph):
        super().__init__()
        self.owner = owner
        self.open: Segment | None = None
        self.recording = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        device = op_device(func, args, kwargs, flat)
        host = self.owner.host
        if device is None or device.type == host or _facts(func).passes:
            return func(*args, **kwargs)
        if self.open is None or self.open.device != device:
            self._start(device)
        used = []
        for i, value in enumerate(flat):
            if isinstance(value, torch.Tensor) and value.device != device and value.device.type != host:
                flat[i] = self._mirror(self.open, value)
                used.append(flat[i])
        if not used:
            return func(*args, **kwargs)
        args, kwargs = tree_unflatten(flat, spec)
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and any(result.untyped_storage().data_ptr() ==
                                                    m.untyped_storage().data_ptr() for m in used):
            result = result.clone()  # `x.to(this GPU)` of a mirror returns it: each caller gets its own, as eagerly
        return result

    def launched(self, device: torch.device) -> None:
        """One of our kernels launches on `device` (kernels/launches.py): its GPU's segment, as for an op."""
        device = torch.device(device)
        if device.type != self.owner.host and (self.open is None or self.open.device != device):
            self._start(device)

    def _start(self, device: torch.device) -> None:
        self._end()
        self.recording = self.owner._begin(device)  # noqa: SLF001
        self.open = Segment(device, self.recording)
        self.owner.segments.append(self.open)

    def _end(self) -> None:
        if self.recording is not None:
            recording, self.recording = self.recording, None
            recording.end()

    def _mirror(self, segment: Segment, source: torch.Tensor) -> torch.Tensor:
        """source's mirror on the segment's GPU (one per source within a segment: nothing of source's GPU runs while
        the segment does). Same strides where source is dense, so views of it behave alike."""
        key = (source.untyped_storage().data_ptr(), source.storage_offset(), tuple(source.shape),
               tuple(source.stride()), source.dtype, source.device)
        mirror = segment.keys.get(key)
        if mirror is None:
            make = getattr(self.owner._begin, "mirror", None)  # noqa: SLF001
            mirror = make(source, segment.device) if make is not None else torch.empty_like(source,
                                                                                             device=segment.device)
            segment.keys[key] = mirror
            segment.mirrors.append((source, mirror))
        return mirror

    def close(self) -> None:
        """End the open recording and give every GPU its stream back (also after a failed record)."""
        try:
            self._end()
        finally:
            restore = getattr(self.owner._begin, "restore", None)  # noqa: SLF001
            if restore is not None:
                restore()
