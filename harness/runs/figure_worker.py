"""A run report's figures drawn in a process of their own while this process writes the report's pages.

The default `harness run --device cuda` spent ~4 s rendering its report after the run, half of it drawing figures
(matplotlib; py-spy on an H200 box, BENCHMARKS.md session 31). `FigureWorker.start()` spawns one process before the
run, so its imports (matplotlib, pandas: seconds) are paid while the run goes; `render_run_report` then hands it
`plots.run_plots` and writes the pages meanwhile. Only where the machine has cores to spare (MIN_CORES): on a 2-core
CPU the replay already runs on both, and the worker's imports would take from it. A worker that fails, or whose
process dies, costs only time: the figures are drawn in this process instead, the same figures.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os

# cores this process may run on, at least, for a figure worker: a 2-core machine (CI, the CPU default run) draws inline
MIN_CORES = 4


def usable_cores() -> int:
    """Cores this process may run on (its affinity, e.g. under taskset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class FigureWorker:
    """One spawned process that imports `reports.plots` at once and then draws what it is handed."""

    def __init__(self) -> None:
        self.pool = futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_load_plots)
        self.pool.submit(int)  # the process starts now (a pool starts its processes at the first submit)

    @classmethod
    def start(cls) -> FigureWorker | None:
        """A worker where this process has MIN_CORES cores or more, else None (the figures are drawn inline)."""
        if usable_cores() < MIN_CORES:
            return None
        try:
            return cls()
        except (OSError, RuntimeError):  # no process to be had here: drawn inline
            return None

    def run_plots(self, *args, **kwargs) -> futures.Future | None:
        """`reports.plots.run_plots(*args, **kwargs)` in the worker; None where it cannot take it."""
        from reports import plots

        try:
            return self.pool.submit(plots.run_plots, *args, **kwargs)
        except RuntimeError:  # the pool is broken or shut down
            return None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def drawn(pending: futures.Future | None, inline):
    """What the worker drew (`pending`), or `inline()` where it did not: no worker, or it raised or died."""
    if pending is not None:
        try:
            return pending.result()
        except Exception:  # noqa: BLE001 - the worker's failure costs time, not the figures: drawn here instead
            pass
    return inline()


def _load_plots() -> None:
    """The worker's start: it dies with its parent (a killed run leaves no process behind) and imports the plots."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    import reports.plots  # noqa: F401 - the import is the point: paid before the first figure
