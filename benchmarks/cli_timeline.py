"""Where one whole `harness` process spends its wall time: each stage of the command, from the interpreter's start
to its end, as a line on stderr (seconds since this script's first line).

    python benchmarks/cli_timeline.py run --device cuda --out /tmp/run --no-progress

Runs `harness.cli.entry` (the `harness` console script) with the arguments given, each stage wrapped with a timer:
the imports, the run's input checks and transformers' first import, the replay, the verdicts, the report, the
summary, and the exit (atexit; the process's end is what `time` prints around it). `phase_time.py` times the replay's
own phases inside `job.run_job`; this times what is around them. `harness` is imported first, as the console script
does: it sets the bytecode cache (harness/__init__.py) before torch is imported.
"""
import atexit
import functools
import importlib
import os
import sys
import time

T0 = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (module, attribute): the stages, each a function the command calls through its module
STAGES = (("harness.run_config", "build_run_config"), ("harness.cli", "_start_cuda_beside"),
          ("harness.runs.library_log", "quiet_libraries"), ("harness.job", "run_job"),
          ("harness.job", "check_run_inputs"), ("harness.job", "_replay_models"), ("harness.job", "write_verdicts"),
          ("harness.job", "write_report"), ("harness.runs.summary", "format_summary"))


def say(what: str) -> None:
    print(f"[{time.perf_counter() - T0:7.2f} s] {what}", file=sys.stderr, flush=True)


def timed(module: str, name: str) -> None:
    owner = importlib.import_module(module)
    function = getattr(owner, name)

    @functools.wraps(function)
    def stage(*args, **kwargs):
        say(f"> {name}")
        try:
            return function(*args, **kwargs)
        finally:
            say(f"< {name}")

    setattr(owner, name, stage)


def main() -> None:
    say("interpreter up")
    import harness  # noqa: F401 - first: the bytecode cache, as the console script has it

    from harness import cli

    say("harness.cli imported (torch with it)")
    for module, name in STAGES:
        timed(module, name)
    from harness.runs.figure_worker import FigureWorkers

    start = FigureWorkers.start.__func__
    FigureWorkers.start = classmethod(lambda cls: (say("figure workers starting"), start(cls))[1])
    atexit.register(say, "atexit: the process ends")
    sys.argv = ["harness", *sys.argv[1:]]
    cli.entry()


if __name__ == "__main__":  # workers of a CPU run import this script again: they must not run the command
    main()
