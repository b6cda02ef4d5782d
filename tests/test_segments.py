"""A layer-sharded decode step recorded as one graph per device (harness/replay/segments.py), on the CPU: "cpu" and
"meta" stand in for two GPUs and a stand-in recorder logs what CUDA graphs would record. Whether the graphs replay
what the eager pass computes is tests/test_multi_gpu.py's (two GPUs, bit for bit against one GPU)."""

from __future__ import annotations

import pytest
import torch

from harness.replay.segments import SegmentedGraph, op_device


class StandIn:
    """begin(device) for SegmentedGraph: logs begin / end / replay per device."""

    def __init__(self):
        self.log: list[tuple[str, str]] = []

    def __call__(self, device):
        log = self.log
        log.append(("begin", str(device)))

        class Graph:
            def end(self):
                log.append(("end", str(device)))

            def replay(self):
                log.append(("replay", str(device)))
        return Graph()


def test_an_op_on_another_device_starts_a_segment_and_reads_what_crosses_from_a_mirror():
    x = torch.arange(6.0).view(2, 3)
    acc = torch.zeros(2)
    recorder = StandIn()
    graph = SegmentedGraph(recorder, host=None)

    def step():
        y = x * 2                          # cpu
        z = y.to("meta")                   # a layer's inputs moved to its device: the meta segment opens
        w = (z + 1)[:, 1:]
        y.t()                              # a view of the other device's tensor: no kernel, no segment
        acc.add_(w.sum(1).to("cpu"))       # a write into the first device's counts: back to it
        return acc * 1

    out = graph.record(step)
    assert graph.devices == ["cpu", "meta", "cpu"]
    assert recorder.log == [("begin", "cpu"), ("end", "cpu"), ("begin", "meta"), ("end", "meta"), ("begin", "cpu"),
                            ("end", "cpu")]
    first, second, third = graph.segments
    assert first.mirrors == []
    [(source, mirror)] = second.mirrors    # y, read by the meta segment's copy
    assert source.device.type == "cpu" and mirror.device.type == "meta" and mirror.shape == (2, 3)
    [(source, mirror)] = third.mirrors     # w.sum(1), made on meta, read back on the cpu
    assert source.device.type == "meta" and mirror.device.type == "cpu" and mirror.shape == (2,)
    assert out.device.type == "cpu"


def test_one_source_read_twice_in_a_segment_has_one_mirror_and_replay_copies_before_each_graph():
    x = torch.ones(4)
    recorder = StandIn()
    graph = SegmentedGraph(recorder, host=None)

    def step():
        a = x + 1
        b = a.to("meta") * 2
        return b + a.to("meta")           # a again: the same mirror (nothing of the cpu runs meanwhile)

    graph.record(step)
    assert graph.devices == ["cpu", "meta"] and graph.mirror_count() == 1
    recorder.log.clear()
    graph.replay()
    assert recorder.log == [("replay", "cpu"), ("replay", "meta")]


def test_a_failed_record_ends_the_open_recording():
    recorder = StandIn()
    graph = SegmentedGraph(recorder, host=None)

    def step():
        (torch.ones(2) + 1).to("meta") * 2
        raise RuntimeError("a layer failed")

    with pytest.raises(RuntimeError, match="a layer failed"):
        graph.record(step)
    assert recorder.log[-1] == ("end", "meta")


@pytest.mark.parametrize("call, expected", [
    (lambda a, b: torch.ops.aten._to_copy.default(a, device=torch.device("meta")), "meta"),   # the target's
    (lambda a, b: torch.ops.aten.add_.Tensor(a, 1), "cpu"),                                     # the written one's
    (lambda a, b: torch.ops.aten.add.Tensor(torch.ones(()), b), "meta"),         # not a host scalar's
    (lambda a, b: torch.ops.aten.zeros.default([2], device=torch.device("meta")), "meta"),     # a factory's
])
def test_the_device_an_op_runs_on(call, expected):
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(op_device(func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    a, b = torch.ones(2), torch.ones(2, device="meta")
    with Spy():
        call(a, b)
    assert str(seen[-1]) == expected


def test_to_reaches_the_mode_undecomposed_under_inference_mode_and_still_mirrors():
    """Under inference mode `x.to(device)` reaches a dispatch mode as aten.to (an op that may alias), not _to_copy:
    on two H200s it ran unrecorded and its copy broke the capture (session 35). It is recorded as its device's op."""
    recorder = StandIn()
    graph = SegmentedGraph(recorder, host=None)
    x = torch.ones(3)

    def step():
        moved = (x + 1).to("meta")
        return moved.to("meta") * 2   # already there: aten.to aliases it; no mirror, no segment

    with torch.inference_mode():
        graph.record(step)
    assert graph.devices == ["cpu", "meta"] and graph.mirror_count() == 1


@pytest.mark.parametrize("call, expected", [
    (lambda a, b: torch.ops.aten.to.device(a, torch.device("meta"), torch.float32), "meta"),  # positional
    (lambda a, b: torch.ops.aten.to.other(a, b), "meta"),                                         # other's
])
def test_the_device_of_to(call, expected):
    test_the_device_an_op_runs_on(call, expected)


@pytest.mark.multigpu
def test_two_gpus_replay_what_the_eager_pass_computes_and_no_temporary_overwrites_a_mirror():
    """A pass over two GPUs recorded as segments replays the eager pass's numbers, step after step. The clone frees a
    temporary of the second GPU's graph before its input is mirrored: a mirror taken from the graphs' pool reused that
    memory, and replay overwrote the copied input with the temporary (rows summed 10 where 12 was right, session 35)."""
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    x0 = torch.arange(4.0, device=d0)
    column = torch.zeros(1, dtype=torch.long, device=d0)
    storage = torch.zeros(8, 4, device=d1)

    def step():
        doubled = x0 * 2
        index = column.to(d1).clone()
        storage.index_copy_(0, index, doubled.to(d1)[None])
        return storage.sum(1).to(d0) * 1

    with torch.inference_mode():
        for i in range(2):  # eager, as the engine's first steps
            column.fill_(i)
            step()
        graph = SegmentedGraph()
        out = graph.record(step)
        assert graph.devices == ["cuda:0", "cuda:1", "cuda:0"]
        for i in range(2, 6):
            column.fill_(i)
            graph.replay()
            assert out.tolist() == [12.0] * (i + 1) + [0.0] * (7 - i), i


def test_a_launch_of_our_kernels_starts_its_devices_segment():
    """Our Triton and NVRTC launchers are not aten ops: they say their device (kernels/launches.py), and a launch on
    another device than the open segment's starts that device's segment, as an op does (else it would run once,
    eagerly, while recording, and never again)."""
    from kernels.launches import LAUNCH_WATCHER, launching

    recorder = StandIn()
    graph = SegmentedGraph(recorder, host=None)

    def step():
        a = torch.ones(2) + 1
        launching(torch.device("meta"))   # a kernel of ours on the other device
        launching(torch.device("meta"))   # the same segment
        return a * 2                       # back on the first

    graph.record(step)
    assert graph.devices == ["cpu", "meta", "cpu"]
    assert LAUNCH_WATCHER.get() is None   # nobody watches after the record
