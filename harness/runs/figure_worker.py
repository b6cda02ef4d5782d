"""A run report's figures drawn in processes of their own while this process writes the report's pages.

The default `harness run --device cuda` spent ~4 s rendering its report after the run, half of it drawing figures
(matplotlib; py-spy on an H200 box, BENCHMARKS.md session 31). `FigureWorkers.start()` starts Python processes
before the run, so their imports (matplotlib, pandas: seconds) are paid while the run goes; `render_run_report` then
hands them the run's figures (`reports.run_figures.run_figure_calls`, one figure a request, dealt round the workers)
and writes the pages meanwhile. One worker for every MIN_CORES cores, at most MAX_WORKERS: on a 2-core CPU the replay
already runs on both, and a worker's imports would take from it. A worker that fails, or whose process dies, costs
only time: its figures are then drawn in this process instead, the same figures.

The worker is a plain `python -c` child fed pickled requests on its stdin, not a multiprocessing pool: a spawned
pool's child imports the parent's `__main__` again, which re-runs a user's script that calls `harness.cli.main`
without a `__main__` guard.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from pathlib import Path

# cores this process may run on for each figure worker: a 2-core machine (CI, the CPU default run) draws inline
MIN_CORES = 4
# workers at most: the default run has 7 figures of 0.2-0.5 s each (this project's EPYC); its report took 2.21 s with
# 4 workers against 3.08 s with one and 4.23 s inline (an H200 box of 16 cores, session 36)
MAX_WORKERS = 4
# seconds a request may wait for its answer: the figures take ~2 s and a worker's first imports a few more (a cold
# machine's font cache too); one still silent after this is killed and the figures are drawn inline, never twice
ANSWER_TIMEOUT_S = 120.0
# the worker: the parent's import roots first, then the plots imported before the first request is read
SERVE = "import sys; sys.path[:0] = {roots!r}; from harness.runs.figure_worker import serve; serve()"


def usable_cores() -> int:
    """Cores this process may run on (its affinity, e.g. under taskset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class FigureWorker:
    """One Python process that imports `reports.plots` at once and then draws what it is handed, one request at a
    time: a pickled (name, args) of `plots.draw_figure` in, a pickled ("ok", figure) or ("error", text) out."""

    def __init__(self) -> None:
        import reports

        import harness

        roots = list(dict.fromkeys(str(Path(m.__file__).resolve().parent.parent) for m in (harness, reports)))
        self.process = subprocess.Popen([sys.executable, "-c", SERVE.format(roots=roots)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.writer: threading.Thread | None = None  # the last request's writer: the next one writes after it
        # its answers in order, read as they come (EOFError last where it died): a select on the pipe would miss an
        # answer the unpickler had already buffered while it read the one before
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=_read_answers, args=(self.process.stdout, self.answers), daemon=True).start()

    def draw(self, name: str, args: tuple) -> Pending | None:
        """`reports.plots.draw_figure(name, args)` in the worker; None where its process has ended. The request is
        written from a thread (a worker still importing would otherwise hold this process at a full pipe), after
        the requests before it. Answers come in the requests' order: read them in that order."""
        if self.process.poll() is not None:
            return None
        request = pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.writer = threading.Thread(target=_write, args=(self.process.stdin, request, self.writer), daemon=True)
        self.writer.start()
        return Pending(self)

    def close(self) -> None:
        """Ended at once: what it drew has been answered and read, or is no longer wanted (drawn inline); a worker
        still importing (a run refused before any work) would otherwise hold the command until it read its input's
        end. Its answers are written after its figures, so none is being written when its answer was read."""
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:  # a broken pipe's buffered request: nothing to deliver any more
                pass


class FigureWorkers:
    """Figure workers side by side, each request to the next one round."""

    def __init__(self, count: int) -> None:
        self.workers: list[FigureWorker] = []
        for _ in range(count):
            try:
                self.workers.append(FigureWorker())
            except OSError:  # no more processes to be had here: fewer workers
                break
        self.turn = 0

    @classmethod
    def start(cls) -> FigureWorkers | None:
        """A worker for every MIN_CORES cores this process has (at most MAX_WORKERS); None where it has fewer, or
        none could start (the figures are drawn inline)."""
        count = min(MAX_WORKERS, usable_cores() // MIN_CORES)
        if count < 1 or not sys.executable:  # an embedded interpreter names no executable
            return None
        pool = cls(count)
        return pool if pool.workers else None

    def draw(self, name: str, args: tuple) -> Pending | None:
        """`FigureWorker.draw` on the next worker."""
        worker = self.workers[self.turn % len(self.workers)]
        self.turn += 1
        return worker.draw(name, args)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


class Pending:
    """A request handed to a worker; `result()` waits for its answer and raises where there is none."""

    def __init__(self, worker: FigureWorker) -> None:
        self.worker = worker

    def result(self):
        """The worker's figure; raises where it failed, died, or stayed silent ANSWER_TIMEOUT_S (then it is killed
        first, so that no figure is being written by it while this process draws them)."""
        try:
            answer = self.worker.answers.get(timeout=ANSWER_TIMEOUT_S)
        except queue.Empty:
            self.worker.process.kill()
            raise TimeoutError(f"the figure worker answered nothing in {ANSWER_TIMEOUT_S:g} s") from None
        if isinstance(answer, BaseException):
            self.worker.answers.put(answer)  # dead for the requests after this one too
            raise answer
        status, value = answer
        if status != "ok":
            raise RuntimeError(f"the figure worker failed: {value}")
        return value


def drawn(pending: Pending | None, inline):
    """What the worker drew (`pending`), or `inline()` where it did not: no worker, or it failed or died."""
    if pending is not None:
        try:
            return pending.result()
        except Exception:  # noqa: BLE001 - the worker's failure costs time, not the figures: drawn here instead
            pass
    return inline()


def _read_answers(pipe, answers: queue.Queue) -> None:
    while True:
        try:
            answers.put(pickle.load(pipe))
        except Exception as error:  # noqa: BLE001 - EOFError where it died or was closed: said to the next `result`
            answers.put(error if isinstance(error, EOFError) else EOFError(f"{type(error).__name__}: {error}"))
            return


def _write(pipe, data: bytes, after: threading.Thread | None = None) -> None:
    if after is not None:
        after.join()
    try:
        pipe.write(data)
        pipe.flush()
    except (OSError, ValueError):  # the worker is gone (a broken pipe, or closed): `result` finds no answer
        pass


def serve() -> None:
    """The worker's loop: it dies with its parent (a killed run leaves no process behind), imports the plots, then
    answers each request on stdin until its end."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the answers' own pipe: a library's print to stdout
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # goes where stderr goes, not into a pickle
    from reports import plots  # the point of starting early: paid before the first request

    requests = sys.stdin.buffer
    while True:
        try:
            name, args = pickle.load(requests)
        except EOFError:
            return
        try:
            answer = ("ok", plots.draw_figure(name, args))
        except Exception as error:  # noqa: BLE001 - said to the parent, which draws inline instead
            answer = ("error", f"{type(error).__name__}: {error}")
        pickle.dump(answer, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()
