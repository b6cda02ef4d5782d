"""One forward context: everything a model call's attention reads of the harness, entered around every model call.

The registered attention function (`attention.register`) is called by transformers, deep inside a model's forward,
with only the module and its tensors. What it must know of the harness for this call (the cache whose layers hold
the path's K/V, the rows batch whose decode steps run each row as alone, an observer that records or replaces
attention outputs, what the load-time probe records, the stream its checks run on beside it: `checks_beside`) is the
`ForwardContext` of the innermost `forward_context` entered around the call, in the shape of nano-vllm's
`utils/context.py`, but a context variable, so concurrent threads and tasks each see their own. Per path and per
sequence state stays where it lives (the cache layers: their format, scales, paged copy, implementation probe); only
per-call state is here.

Every model call in the project enters it: generate, score, calibrate, capture, serve, sensitivity, the load-time
probe, and each rank of a sharded or tensor-parallel model (they call through the same engine). A field not given
is inherited from the enclosing context: a capture session's observer holds over the calls it wraps.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardContext:
    # the cache (transformers' DynamicCache holding our layers) this call writes and reads; None: the model's own
    # attention over whatever cache it was handed (the reference)
    cache: object = None
    # a rows batch (`batched.RowKeys`): its decode steps attend each row over its own keys, as it would run alone
    rows: object = None
    # (module, query, key, value, output) -> a tensor to use as the output, or None: calibration's query amax,
    # attention capture (isolated mode replaces outputs)
    observe: Callable | None = None
    # the names of the attention arguments beyond SDPA seen in this call (`attention.BEYOND_SDPA`), where recorded
    seen_beyond_sdpa: set | None = None
    # per call notes, fresh at each entry: the query length of the attention modules' current call
    notes: dict | None = None
    # a CUDA stream the call's checks run on beside the model's own (`checks_beside`); None: on the model's stream
    checks_stream: object = None
    # a static prefill pass whose full-attention mask is causal over each row's real keys and nothing else
    # (`CausalPrefix`: `BatchedEngine._prefill_static`); an attention call handed that very mask may compute it as
    # a lower-right causal bias instead of reading it
    causal_prefix: object = None
    # a pass the implementation check does not sample (impl_check.py): a static prefill's middle chunk of a batch
    # whose middle chunks one GPU replays as a CUDA graph (a replay runs no Python), however this one runs
    # (`BatchedEngine._prefill_static`), so that a layer-sharded run samples the chunks one GPU's run samples
    unprobed: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class CausalPrefix:
    """A static prefill pass's full-attention mask (`mask`, the tensor the model is handed) and, per row, the first
    column it attends to (`starts`: the row's left pads, on the host). The pass's queries are its columns, and the
    keys it reads end at its last: a row's query from its start on attends to the row's columns from its start up to
    itself, a query before it (a pad) to itself alone."""
    mask: torch.Tensor
    starts: tuple[int, ...]


_CURRENT: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar("harness_forward", default=ForwardContext())


def current() -> ForwardContext:
    """The context of the model call now running (an empty one outside every model call)."""
    return _CURRENT.get()


@contextlib.contextmanager
def forward_context(**fields) -> Iterator[ForwardContext]:
    """Enter around a model call (or a loop of them): `fields` override the enclosing context's (see the module)."""
    context = dataclasses.replace(_CURRENT.get(), notes={}, **fields)
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


_THREAD = threading.local()  # this thread's own streams (`own_stream`)

# Held around what touches every stream of a GPU or the allocator's shared pool while another thread may be
# replaying another model on the same GPU (`executor.local.ModelThreads`): a CUDA graph's capture, a device-wide
# synchronise, `torch.cuda.empty_cache()`. torch's allocator asserts that no capture is under way when it frees its
# cached blocks, and a device-wide synchronise cannot wait on a stream being captured.
DEVICE_WIDE = threading.RLock()

# torch's SDPA backend choice (`torch.nn.attention.sdpa_kernel`) is a set of process-wide flags, not a per-call
# argument: one thread's choice held while another thread's call reads them would change that call's backend, so
# its bits. `sdpa_only` holds this while its choice is set.
_SDPA_FLAGS = threading.RLock()


def own_stream(purpose: str, device: torch.device) -> "torch.cuda.Stream":
    """This thread's stream for `purpose` on `device` (made at first use): threads replaying models at once each
    queue their checks and captures on streams of their own, not behind another model's work."""
    streams = getattr(_THREAD, "streams", None)
    if streams is None:
        streams = _THREAD.streams = {}
    key = (purpose, device)
    if key not in streams:
        streams[key] = torch.cuda.Stream(device)
    return streams[key]


@contextlib.contextmanager
def sdpa_only(backends) -> Iterator[None]:
    """`torch.nn.attention.sdpa_kernel(backends)` around the block, the flags held for this thread alone
    (`_SDPA_FLAGS`): keep the block to the SDPA calls it chooses for."""
    from torch.nn.attention import sdpa_kernel

    with _SDPA_FLAGS, sdpa_kernel(backends):
        yield


@contextlib.contextmanager
def checks_beside(device: torch.device) -> Iterator[None]:
    """Enter around a model call whose checks may run beside it (a CUDA device): the write check and the prompt-end
    kernel check read what the call has written and feed nothing back into it, so on a second stream their
    memory-bound work overlaps the call's compute-bound prefill (`on_checks_stream`). The model's stream waits for
    every check when the call ends, so whatever reads their results after it sees them complete."""
    if device.type != "cuda":
        yield
        return
    stream = own_stream("checks", torch.device("cuda", device.index if device.index is not None else
                                                torch.cuda.current_device()))
    try:
        with forward_context(checks_stream=stream):
            yield
    finally:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


@contextlib.contextmanager
def on_checks_stream(*inputs: torch.Tensor) -> Iterator[None]:
    """Run the block on the call's checks stream, where `checks_beside` set one and `inputs` are on its device,
    after everything queued so far on the model's stream; `inputs` (the model's tensors the block reads) are not
    reused by the caching allocator until the block's work is done. Elsewhere the block runs where it is. Tensors
    the block makes live on the checks stream: what the model's stream reads later must be made before it."""
    stream = _CURRENT.get().checks_stream
    if stream is None:
        yield
        return
    model_stream = torch.cuda.current_stream(stream.device)
    if any(t.device != stream.device for t in inputs):
        # a layer on another GPU (layer-sharded) is checked where it runs; its results are added into the same
        # statistics on this device, on the model's stream: after the checks already queued beside it
        model_stream.wait_stream(stream)
        yield
        return
    stream.wait_stream(model_stream)
    for tensor in inputs:
        tensor.record_stream(stream)
    with torch.cuda.stream(stream):
        yield


def note(name: str, value) -> None:
    """Record a per-call note in the context now running (nothing outside a model call)."""
    notes = _CURRENT.get().notes
    if notes is not None:
        notes[name] = value
