"""One forward context: everything a model call's attention reads of the harness, entered around every model call.

The registered attention function (`attention.register`) is called by transformers, deep inside a model's forward,
with only the module and its tensors. What it must know of the harness for this call (the cache whose layers hold
the path's K/V, the rows batch whose decode steps run each row as alone, an observer that records or replaces
attention outputs, what the load-time probe records) is the `ForwardContext` of the innermost `forward_context`
entered around the call, in the shape of nano-vllm's `utils/context.py`, but a context variable, so concurrent
threads and tasks each see their own. Per path and per sequence state stays where it lives (the cache layers:
their format, scales, paged copy, implementation probe); only per-call state is here.

Every model call in the project enters it: generate, score, calibrate, capture, serve, sensitivity, the load-time
probe, and each rank of a sharded or tensor-parallel model (they call through the same engine). A field not given
is inherited from the enclosing context: a capture session's observer holds over the calls it wraps.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator


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


def note(name: str, value) -> None:
    """Record a per-call note in the context now running (nothing outside a model call)."""
    notes = _CURRENT.get().notes
    if notes is not None:
        notes[name] = value
