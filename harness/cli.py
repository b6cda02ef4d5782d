"""`harness`: replay scenarios through a BF16 reference and FP8 KV-cache paths; report where they differ."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from harness.kv_paths.spec import PathSpecError

EPILOG = """\
examples:
  harness run                                   # bundled canaries x canary scenarios x default paths, on CPU
  harness run --paths bf16,fp8_e4m3:per_head:calibrated --model path/to/hf_model --scenarios scenarios/general
  harness run --out runs/nightly --resume       # finish an interrupted run without redoing finished work

KV path specs:  format[:granularity][:scale source][:cast][:prefill]
  format        bf16 | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2
  granularity   per_tensor (default) | per_head | per_token (dynamic, from each token)
  scale source  default (1.0) | calibrated (amax/max over prompts) | checkpoint (k_scale/v_scale) |
                warmup (one dummy pass, recurrent state uninitialised)
  cast          sat (default, clamp to +-max) | nosat (torch's plain cast: e4m3 overflow -> NaN)
  prefill       quantized_prefill (default) | raw_prefill (a prefill chunk attends to its raw K/V)
  fault preset  k_scale_on_scores (bf16 cache only, with calibrated/checkpoint scales: failure class 3,
                k_scale multiplied into the attention scores; `harness zoo` runs every preset)
  kernel=NAME   decode through: triton (default on CUDA) | dequant (dequantise-everything workaround) |
                reference | package.module:function (your own; contract in docs/CONTRACTS.md)
"""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="replay scenarios and store a run", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--model", action="append", type=Path, metavar="DIR",
                     help="local transformers model directory (repeatable); default: the bundled canaries")
    run.add_argument("--scenarios", action="append", type=Path, metavar="PATH",
                     help="scenario file or directory (repeatable); default: scenarios/canary/*.yaml")
    run.add_argument("--paths", default=None, metavar="SPECS",
                     help="comma-separated KV path specs; bf16 is always added (noise floor). "
                          "default: bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated,fp8_e5m2")
    run.add_argument("--out", type=Path, metavar="DIR", help="run directory (default: runs/<time>-<id>)")
    run.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: cpu)")
    run.add_argument("--history-mode", default="reference-history", choices=["reference-history", "own-history"],
                     help="what earlier turns a path sees: the reference's replies or its own")
    run.add_argument("--calibration", action="append", type=Path, metavar="PATH",
                     help="scenario file(s) whose chats calibrate 'calibrated' scales (default: a built-in set)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out, skipping finished work")
    run.add_argument("--threshold", action="append", metavar="METRIC:LIMIT",
                     help="verdict limit replacing the default or scenario one, e.g. kl_max:0.5 (repeatable)")
    run.add_argument("--no-fail-on-verdict", action="store_true",
                     help="exit 0 even when a path fails its verdict checks (default: exit 1)")
    live = run.add_argument_group("live endpoints (OpenAI-compatible servers, e.g. vLLM or SGLang)")
    live.add_argument("--reference", metavar="URL", help="server with the reference (BF16) cache")
    live.add_argument("--candidate", action="append", metavar="[LABEL=]URL", help="server(s) to check (repeatable)")
    live.add_argument("--judge", metavar="URL", help="OpenAI-compatible server whose model grades replies 1-5")
    live.add_argument("--judge-turns", choices=["diverged", "all"], default="diverged",
                      help="turns the LLM judge sees (default: only turns that diverged)")
    live.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key (never stored)")
    live.add_argument("--tokenizer", metavar="NAME_OR_DIR", help="local tokenizer for servers without /tokenize")
    serve = commands.add_parser("serve", help="serve a model with a KV path over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", type=Path, metavar="DIR", help="default: the bundled GQA canary")
    serve.add_argument("--path", default="bf16", metavar="SPEC", help="KV path spec, or 'reference' (default: bf16)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", default="cpu")
    run.add_argument("--jobs", type=int, default=None, metavar="N",
                     help="models replayed at once, one process each (CPU; default: one per core, at most one per model)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    report = commands.add_parser("report", help="(re-)render a stored run's HTML report")
    report.add_argument("run", type=Path, metavar="RUN")
    report.add_argument("--out", type=Path, metavar="DIR", help="default: RUN/report")
    compare = commands.add_parser("compare", help="compare two stored runs; exit 1 on a regression (for CI)")
    compare.add_argument("run_a", type=Path, metavar="RUN_A", help="the baseline")
    compare.add_argument("run_b", type=Path, metavar="RUN_B", help="the candidate")
    compare.add_argument("--out", type=Path, metavar="DIR", help="default: ./compare-<A>-vs-<B>")
    compare.add_argument("--threshold", action="append", metavar="SPEC",
                         help="e.g. kl_max:+0.02 (B may be worse than A by at most this) or kl_max:0.05 (a limit)")
    zoo = commands.add_parser("zoo", help="run the failure-class zoo and print the detection matrix (exit 1 if "
                                          "a fault is missed or a healthy path fails)")
    zoo.add_argument("--out", type=Path, metavar="RUN_DIR", help="run directory (default: runs/<time>-zoo)")
    zoo.add_argument("--scenarios", type=Path, nargs="+", help="scenario files (default: scenarios/canary/default.yaml)")
    zoo.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="models replayed at once (CPU)")
    zoo.add_argument("--device", default="cpu", help="cpu | cuda (cuda adds class 4: our MLA kernel vs the workaround)")
    zoo.add_argument("--stress", action="store_true", help="also the other stress variants (measured, not asserted)")
    scores = commands.add_parser("judge-scores", help="mean 1-5 judge score per model and path over a run's "
                                                      "multi-turn scenarios (markdown)")
    scores.add_argument("run", type=Path, metavar="RUN_DIR")
    scores.add_argument("--all-scenarios", action="store_true", help="single-turn scenarios too")
    export = commands.add_parser("export", help="export a run's records as a table")
    export.add_argument("run", type=Path, metavar="RUN")
    export.add_argument("--format", choices=["csv", "parquet"], default="csv")
    export.add_argument("--out", type=Path, metavar="PATH", help="file or directory (default: RUN/records.FORMAT)")
    return parser


def _report(args: argparse.Namespace) -> int:
    from harness.runs.report import render_run_report

    print(render_run_report(args.run, args.out))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from harness.runs.compare import compare_runs, default_compare_dir

    result = compare_runs(args.run_a, args.run_b, out_dir=args.out or default_compare_dir(args.run_a, args.run_b),
                          thresholds=args.threshold)
    print(result.summary_line)
    print(f"report: {result.report_path}", file=sys.stderr)
    return 1 if result.regressed else 0


def _export(args: argparse.Namespace) -> int:
    from harness.runs.report import export_run

    print(export_run(args.run, args.format, args.out))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from harness.serve import serve

    serve(args.model, args.path, args.host, args.port, args.device)
    return 0


def _raise_interrupt(signum, frame):
    """SIGTERM acts as Ctrl-C. Re-sent as SIGINT, so that inside `asyncio.run` the runner's own handler
    cancels the replay and then raises KeyboardInterrupt (rather than an exception thrown into whichever
    task was running, which leaves the others pending and prints their tracebacks)."""
    signal.raise_signal(signal.SIGINT)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="unit", desc="scenario x path", dynamic_ncols=True, file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from harness import job
    from harness.analysis.verdicts import parse_threshold_overrides
    from harness.runs.store import RunStoreError
    from harness.scenarios.load import ScenarioError

    warnings, config = [], None
    if bool(args.reference) != bool(args.candidate):
        print("error: --reference and --candidate go together (a reference server and at least one candidate)",
              file=sys.stderr)
        return 2
    if args.reference:
        models = ()
    elif args.model:
        models = tuple(args.model)
    else:
        models, warning = job.default_models()
        if warning:
            warnings.append(warning)
            print(f"warning: {warning}", file=sys.stderr)
    if args.resume and not args.out:
        print("error: --resume needs --out RUN_DIR (the run to continue)", file=sys.stderr)
        return 2
    try:
        parse_threshold_overrides(args.threshold)  # refuse a bad --threshold before any work
        config = job.RunConfig(
            models=models, scenario_paths=tuple(args.scenarios or job.default_scenarios()),
            paths=() if args.reference else job.parse_kv_paths(args.paths or job.DEFAULT_PATHS),
            out=args.out or job.new_run_dir(),
            device=job.resolve_device(args.device), history_mode=args.history_mode, resume=args.resume,
            calibration_paths=tuple(args.calibration or ()), reference_url=args.reference,
            candidate_urls=tuple(args.candidate or ()), judge_url=args.judge, judge_selection=args.judge_turns,
            api_key_env=args.api_key_env, tokenizer=args.tokenizer,
            jobs=args.jobs if args.jobs is not None else (os.cpu_count() or 1),
            thresholds=tuple(args.threshold or ()),
            command=shlex.join(["harness", *sys.argv[1:]]))
        started = time.perf_counter()
        run_dir = job.run_job(config, progress=None if args.no_progress else _progress,
                              warn=lambda m: print(m, file=sys.stderr))
    except (PathSpecError, ScenarioError, RunStoreError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = f"--out {config.out} " if config else ""
        print(f"\ninterrupted: finished work is stored; continue with "
              f"harness run {where}--resume (same arguments)", file=sys.stderr)
        return 130
    failing = _print_run_end(run_dir, time.perf_counter() - started, warnings)
    return 1 if failing and not args.no_fail_on_verdict else 0


def _print_run_end(run_dir: Path, seconds: float, warnings: list[str]) -> list[tuple[str, str]]:
    """Print the summary (verdict matrix first); return the (model, path) pairs that failed their verdicts."""
    from harness import job
    from harness.runs.store import RunStore
    from harness.analysis.verdicts import failing_paths
    from harness.runs.summary import format_summary

    store = RunStore(run_dir)
    manifest = store.read_manifest()
    report = job.write_report(run_dir)
    print(format_summary(run_dir))
    for model, floor in manifest.get("noise_floor", {}).items():
        worst = max(floor.values(), default=0.0)
        state = "exactly zero" if worst == 0 else f"NONZERO (worst {worst:.3g}): bf16 path differs from reference"
        print(f"noise floor {model}: {state}")
    for warning in manifest.get("warnings", []) + warnings:
        print(f"warning: {warning}")
    errors = store.read("errors")
    if errors:
        print(f"{len(errors)} unit(s) failed; see {run_dir / 'errors.jsonl'}; rerun with --resume to retry")
    print(f"run {manifest['status']} in {seconds:.1f} s: {run_dir}")
    print(f"report: {report}")
    failing = failing_paths(manifest.get("verdicts") or {})
    if failing:
        print("VERDICT FAIL: " + ", ".join(f"{model} {path}" for model, path in failing)
              + " (a path failed its checks; see verdicts.jsonl)")
    return failing


def _zoo(args: argparse.Namespace) -> int:
    from harness import job
    from harness.zoo import run_zoo

    default = job.new_run_dir()
    out = args.out or default.with_name(default.name + "-zoo")
    detection = run_zoo(out, tuple(args.scenarios) if args.scenarios else None, job.resolve_device(args.device),
                        args.jobs, shlex.join(["harness", *sys.argv[1:]]), stress=args.stress)
    print(detection["markdown"])
    for case in detection["spec_cases"]:
        print(f"class 5 {'ok ' if case['ok'] else 'BAD'} {case['spec']} ({case['model'] or 'any model'}): {case['got']}")
    print(f"report: {job.write_report(out)}")
    return 0 if detection["ok"] else 1


def _judge_scores(args: argparse.Namespace) -> int:
    from harness.runs.judge_scores import format_judge_scores, judge_score_rows

    if not (args.run / "records.jsonl").is_file():
        raise FileNotFoundError(f"{args.run} is not a run directory (no records.jsonl)")
    print(format_judge_scores(judge_score_rows(args.run, multi_turn_only=not args.all_scenarios)))
    return 0


COMMANDS = {"judge-scores": _judge_scores, "zoo": _zoo, "run": _run, "report": _report, "compare": _compare, "export": _export, "serve": _serve}


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "run":
        signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed CI job marks its run interrupted
        # ...through SIGINT, which a shell's background job (a CI step, `cmd &`) starts with ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return _run(args)
    try:
        return COMMANDS[args.command](args)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
