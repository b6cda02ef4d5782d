"""`harness`: replay scenarios through a BF16 reference and FP8 KV-cache paths; report where they differ."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from harness import __version__, attention_cli
from harness.kv_paths.spec import DEFAULT_PATHS, PathSpecError
from harness.records import scrub_credentials
from harness.runs.figure_worker import FigureWorkers

EPILOG = """\
examples:
  harness run                                   # bundled canaries x canary scenarios x default paths, on CPU
  harness run --paths bf16,fp8_e4m3:per_head:calibrated --model path/to/hf_model --scenarios scenarios/general
  harness run --out runs/nightly --resume       # finish an interrupted run without redoing finished work

KV path specs:  format[:granularity][:scale source][:cast][:prefill][:option...]
  format        bf16 | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2 | nvfp4 | mxfp8 | fp8_ds_mla | ... (docs/FORMATS.md);
                k=FORMAT/v=FORMAT (v=bf16: V unquantised); an engine's value: vllm:VALUE | sglang:VALUE
  granularity   per_tensor (default) | per_head | per_token (dynamic, from each token)
  scale source  default (1.0) | calibrated (amax/max over prompts) | checkpoint (k_scale/v_scale) |
                warmup (one dummy pass, recurrent state uninitialised)
  cast          sat (default, clamp to +-max) | nosat (torch's plain cast: e4m3 overflow -> NaN)
  prefill       quantized_prefill (default) | raw_prefill (a prefill chunk attends to its raw K/V) |
                prefill=FORMAT (a prefill chunk attends to its K/V in FORMAT; decode reads the cache's)
  keep_bf16=    layer indices and/or sliding_window joined by '+' (vLLM's --kv-cache-dtype-skip-layers)
  hadamard      K (and Q at attention) rotated over head_dim before K is quantised
  fault preset  k_scale_on_scores (bf16 cache only, with calibrated/checkpoint scales: failure class 3,
                k_scale multiplied into the attention scores; `harness zoo` runs every preset)
  kernel=NAME   decode through: triton (default on CUDA) | dequant (dequantise-everything workaround) |
                reference | package.module:function (your own; contract in docs/CONTRACTS.md)
"""


DEVICE_HELP = "cpu | cuda | cuda:N | auto (cuda when torch sees a GPU, else cpu); default: cpu"
SEVERAL_DEVICES = ("; or several GPUs of this host, one worker each (data-parallel): cuda:N,M,... | cuda:all")


def _bounded_int(low: int, high: int | None):
    """An argparse type: an integer in [low, high]; anything else is a usage error (exit 2), not a traceback."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {low}..{high}, got {value}" if high is not None
                                             else f"must be at least {low}, got {value}")
        return value
    return parse


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0; anything else is a usage error (exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the harness version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="replay scenarios and store a run", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_options(run)
    serve = commands.add_parser("serve", help="serve a model with a KV path over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", type=Path, metavar="DIR", help="default: the bundled GQA canary")
    serve.add_argument("--path", default="bf16", metavar="SPEC", help="KV path spec, or 'reference' (default: bf16)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=_bounded_int(1, 65535), default=8000, help="TCP port (default: 8000)")
    _add_device(serve)
    report = commands.add_parser("report", help="(re-)render a stored run's HTML report")
    report.add_argument("run", type=Path, metavar="RUN", help="a stored run directory (holds manifest.json)")
    report.add_argument("--out", type=Path, metavar="DIR", help="default: RUN/report")
    compare = commands.add_parser("compare", help="compare two stored runs; exit 1 on a regression (for CI)")
    compare.add_argument("run_a", type=Path, metavar="RUN_A", help="the baseline")
    compare.add_argument("run_b", type=Path, metavar="RUN_B", help="the candidate")
    compare.add_argument("--out", type=Path, metavar="DIR", help="default: ./compare-<A>-vs-<B>")
    compare.add_argument("--threshold", action="append", metavar="SPEC",
                         help="e.g. kl_max:+0.02 (B may be worse than A by at most this) or kl_max:0.05 (a limit)")
    nightly = commands.add_parser("nightly", help="one night of the nightly job on this machine: run, compare with "
                                  "the last night, render the trend page; exit 1 on a failing path or a regression")
    nightly.add_argument("--history", type=Path, default=Path("runs/nightly"), metavar="DIR",
                         help="where nights are kept (default: runs/nightly); trend page: DIR/trend/index.html")
    nightly.add_argument("--night", metavar="NAME", help="tonight's name (default: the time)")
    nightly.add_argument("--model", action="append", type=Path, metavar="DIR", help="default: the bundled canaries")
    nightly.add_argument("--scenarios", action="append", type=Path, metavar="PATH", help="default: canary scenarios")
    nightly.add_argument("--paths", metavar="SPECS", help="KV path specs (default: the healthy defaults)")
    _add_device(nightly, several=True)
    nightly.add_argument("--suite", choices=("default", "stress", "all"), default="default",
                         help="default: --model/--scenarios/--paths; stress: the stress canaries (their own models, "
                              "scenarios and paths; histories under DIR/stress/; on the CPU one 16k-token needle)")
    zoo = commands.add_parser("zoo", help="run the failure-class zoo and print the detection matrix (exit 1 if "
                                          "a fault is missed or a healthy path fails)")
    zoo.add_argument("--out", type=Path, metavar="RUN_DIR", help="run directory (default: runs/<time>-zoo)")
    zoo.add_argument("--scenarios", type=Path, nargs="+", help="scenario files (default: scenarios/canary/default.yaml)")
    zoo.add_argument("--jobs", type=_bounded_int(1, None), default=os.cpu_count() or 1, help="models replayed at once (CPU)")
    _add_device(zoo, "; cuda adds class 4: our MLA kernel vs the workaround", several=True)
    zoo.add_argument("--stress", action="store_true",
                     help="also the other stress variants (measured, not asserted) and the long-context canary on its "
                          "16k-token needles (RUN_DIR/long-context; bf16 and calibrated e4m3 asserted healthy; the "
                          "first needle only on the CPU)")
    scores = commands.add_parser("judge-scores", help="mean 1-5 judge score per model and path over a run's "
                                                      "multi-turn scenarios (markdown)")
    scores.add_argument("run", type=Path, metavar="RUN_DIR", help="a stored run directory (holds manifest.json)")
    scores.add_argument("--all-scenarios", action="store_true", help="single-turn scenarios too")
    export = commands.add_parser("export", help="export a run's records as a table")
    export.add_argument("run", type=Path, metavar="RUN", help="a stored run directory (holds manifest.json)")
    export.add_argument("--format", choices=["csv", "parquet"], default="csv",
                        help="csv (default) or parquet (needs pyarrow); one row per model, scenario, path, turn, metric")
    export.add_argument("--out", type=Path, metavar="PATH", help="file or directory (default: RUN/records.FORMAT)")
    attention = commands.add_parser("attention", help="harness run --attention isolated, plus where each path's "
                                    "attention broke (takes every run option)", epilog=EPILOG,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_options(attention, attention_default="isolated")
    sensitivity = commands.add_parser("sensitivity", help="FP8 on one attention layer at a time: ranking and a "
                                      "per-layer precision map")
    attention_cli.add_sensitivity_options(sensitivity)
    _add_device(sensitivity)
    calibrate = commands.add_parser("calibrate", help="write k_scale/v_scale files vLLM and SGLang load (and "
                                    ":checkpoint reads)")
    attention_cli.add_calibrate_options(calibrate)
    _add_device(calibrate)
    scenarios = commands.add_parser("scenarios", help="scenario tools: turn a JSONL task file into a scenario file")
    scenario_tools = scenarios.add_subparsers(dest="scenarios_command", required=True)
    from_jsonl = scenario_tools.add_parser("from-jsonl", help="JSONL task items (GSM8K question/answer, needles) -> "
                                                              "a YAML scenario file")
    from_jsonl.add_argument("file", type=Path, metavar="FILE.jsonl", help="the task file")
    from_jsonl.add_argument("--out", type=Path, required=True, metavar="DIR", help="writes DIR/<FILE stem>.yaml")
    return parser


def _add_run_options(run: argparse.ArgumentParser, attention_default: str | None = None) -> None:
    """`harness run`'s options; `harness attention` takes the same with capture on by default."""
    run.add_argument("--model", action="append", type=Path, metavar="DIR",
                     help="local transformers model directory (repeatable); default: the bundled canaries")
    run.add_argument("--scenarios", action="append", type=Path, metavar="PATH",
                     help="scenario file or directory (repeatable); default: scenarios/canary/*.yaml")
    run.add_argument("--tasks", action="append", type=Path, metavar="FILE.jsonl",
                     help="your own task items, one JSON object per line (GSM8K-style question/answer, or needle/"
                          "question/answer), replayed as scenarios (repeatable; harness/scenarios/tasks.py); "
                          "without --scenarios only these run")
    run.add_argument("--select", action="append", metavar="TERMS",
                     help="keep only scenarios matching any term (comma-separated, repeatable): tag:NAME, "
                          "kind:NAME (chat, arithmetic, recall, long_context), id:GLOB, or a bare GLOB "
                          "matched against id, tags and kind; e.g. --select kind:recall,id:canary-arith-1")
    run.add_argument("--models", action="append", metavar="LABELS",
                     help="keep only the models with these labels (directory names, comma-separated), "
                          "of --model or the bundled canaries; e.g. --models mla,hybrid")
    run.add_argument("--paths", default=None, metavar="SPECS",
                     help="comma-separated KV path specs (see below); bf16 is always added (noise floor). "
                          "default: " + ", ".join(DEFAULT_PATHS.split(",")))
    run.add_argument("--out", type=Path, metavar="DIR", help="run directory (default: runs/<time>-<id>)")
    _add_device(run, several=True)
    run.add_argument("--shard", choices=("layers", "tensor"), default=None,
                     help="one model over the GPUs of --device (e.g. --device cuda:0,1 --shard layers): its decoder "
                          "layers split in blocks across them in this process, for a model too big for one GPU "
                          "(batched; a graph-decoded step is one CUDA graph per GPU); 'tensor': a process per GPU, "
                          "each holding its slice of every layer (transformers' tensor-parallel plan; batched in "
                          "lockstep, dynamic decode; "
                          "under torchrun, one host or several, with --device cuda: each process one rank; "
                          "docs/MULTI_GPU.md)")
    run.add_argument("--executor", choices=("auto", "local", "ray"), default="auto",
                     help="where units run: auto/local on this host (this process, CPU worker processes, a process "
                          "per GPU of a GPU list, or the --shard layout), ray: one actor per GPU (or CPU slot) of a Ray "
                          "cluster, this process the only writer of the run (pip install 'fp8-harness[ray]'; "
                          "docs/MULTI_GPU.md)")
    run.add_argument("--ray-address", metavar="ADDR",
                     help="the Ray cluster of --executor ray (e.g. 10.0.0.1:6379, or auto: the one `ray start` "
                          "made on this host); default: a local cluster for this run")
    run.add_argument("--workers", type=_bounded_int(1, None), default=None, metavar="N",
                     help="GPUs of a GPU list (or Ray actors) to use; default: as many as pay off for the run's "
                          "estimated work (the manifest's parallel.why says how many and why)")
    run.add_argument("--stall-timeout", type=_positive_seconds, default=None, metavar="SECONDS",
                     help="stop a worker that has stored units and then stores none for this long: a local pool stops "
                          "the run (resumable), Ray retries its tasks on the other actors (default: no limit)")
    run.add_argument("--history-mode", default="reference-history", choices=["reference-history", "own-history"],
                     help="what earlier turns a path sees: the reference's replies or its own")
    run.add_argument("--calibration", action="append", type=Path, metavar="PATH",
                     help="scenario file(s) whose chats calibrate 'calibrated' scales (default: a built-in set)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out, skipping finished work")
    run.add_argument("--threshold", action="append", metavar="METRIC:LIMIT",
                     help="verdict limit replacing the default or scenario one, e.g. kl_p999:0.5 (repeatable)")
    run.add_argument("--yardstick", default=None, metavar="SPEC",
                     help="accepted KV path the verdicts measure divergence against, run beside the others in "
                          "process (default: fp8_e4m3:calibrated; 'none': no yardstick, absolute limits only; "
                          "docs/VERDICTS.md)")
    run.add_argument("--scales", type=Path, metavar="FILE",
                     help="k_scale/v_scale safetensors (e.g. from harness calibrate) for ':checkpoint' paths "
                          "(default: the model directory's *.safetensors)")
    _add_attention_options(run, attention_default)
    live = run.add_argument_group("live endpoints (OpenAI-compatible servers, e.g. vLLM or SGLang)")
    live.add_argument("--reference", metavar="URL", help="server with the reference (BF16) cache")
    live.add_argument("--candidate", action="append", metavar="[LABEL=]URL", help="server(s) to check (repeatable)")
    live.add_argument("--self-consistency", action="store_true",
                      help="also check each candidate server against itself: the logprobs of its decode vs its "
                           "prefill of the same tokens, and a repeated decode (prefix-cache hit); with --candidate "
                           "alone (no --reference) the run is that check only (docs/VERDICTS.md)")
    live.add_argument("--judge", metavar="URL", help="OpenAI-compatible server whose model grades replies 1-5")
    live.add_argument("--judge-turns", choices=["diverged", "all"], default="diverged",
                      help="turns the LLM judge sees (default: only turns that diverged)")
    live.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key (never stored)")
    live.add_argument("--tokenizer", metavar="NAME_OR_DIR", help="local tokenizer for servers without /tokenize")
    live.add_argument("--concurrency", type=_bounded_int(1, 1024), default=8, metavar="N",
                      help="scenarios replayed at once against the servers (default: 8; each server also caps its "
                           "requests in flight at 16)")
    live.add_argument("--request-timeout", type=_positive_seconds, default=120.0, metavar="SECONDS",
                      help="one HTTP attempt against a server, connect to last byte; a hanging server costs this "
                           "per attempt (default: 120; recorded in the manifest)")
    _add_endpoint_options(live)
    run.add_argument("--jobs", type=_bounded_int(1, None), default=None, metavar="N",
                     help="worker processes of a CPU replay (default: one per core): one at a time, each model's "
                          "reference and then each of its paths is a task; batched (--batch-size), one model per "
                          "worker. On one GPU: models replayed at once, a thread each, where their weights total at "
                          "most 1 GiB (default: every model; 1: one after another)")
    run.add_argument("--batch-size", type=int, default=None, metavar="N",
                     help="in-process replay in batches of N sequences (default: batched on CUDA, sized from free "
                          "GPU memory, halved on out-of-memory; one at a time on CPU)")
    run.add_argument("--kernel-check-every", type=int, default=16, metavar="STEPS",
                     help="batched replay: check the FP8 decode kernel against fp64 at each prompt's end and every "
                          "STEPS decode steps after it (default: 16)")
    run.add_argument("--decode", choices=("auto", "dynamic", "static", "graph"), default="auto",
                     help="batched replay's decode: a growing cache (dynamic), a preallocated one written in place "
                          "(static), or static with every decode step one CUDA graph replay (graph); default auto: "
                          "graph on CUDA, dynamic elsewhere")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--no-fail-on-verdict", action="store_true",
                     help="exit 0, not 1, when a path's verdict failed (exit 3 for missing units still holds)")


def _add_device(parser: argparse.ArgumentParser, note: str = "", several: bool = False) -> None:
    """--device, declared once for every command that loads a model (`several`: it takes a GPU list)."""
    parser.add_argument("--device", default="cpu", metavar="DEVICE",
                        help=DEVICE_HELP + (SEVERAL_DEVICES if several else "") + note)


def _add_endpoint_options(live) -> None:
    """Per-endpoint model names and API-key variables (default: /v1/models' only model, --api-key-env)."""
    live.add_argument("--reference-model", metavar="NAME", help="model the reference server serves")
    live.add_argument("--candidate-model", action="append", metavar="[LABEL=]NAME",
                      help="model a candidate serves (repeatable; NAME alone: every candidate)")
    live.add_argument("--judge-model", metavar="NAME", help="model the judge server serves")
    for role in ("reference", "candidate", "judge"):
        live.add_argument(f"--{role}-api-key-env", metavar="VAR", help=f"API-key variable for the {role} server")


def _endpoint_config(args: argparse.Namespace) -> dict:
    """The RunConfig fields of the per-endpoint options."""
    keys = tuple((role, getattr(args, f"{role}_api_key_env")) for role in ("reference", "candidate", "judge")
                 if getattr(args, f"{role}_api_key_env"))
    return dict(reference_model=args.reference_model, candidate_models=tuple(args.candidate_model or ()),
                judge_model=args.judge_model, api_key_envs=keys)


def _print_judge_problem(run_dir: Path) -> None:
    """Name the LLM judge that gave no usable verdict (the run then exits 3, runs/status.py)."""
    from harness.judges.usable import llm_judge_problem
    from harness.runs.store import RunStore

    problem = llm_judge_problem(RunStore(run_dir))
    if problem:
        print(f"error: {problem}", file=sys.stderr)


def _add_attention_options(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    group = parser.add_argument_group("attention-score error (in-process models)")
    group.add_argument("--attention", choices=["isolated", "end-to-end"], default=default,
                       help="capture each path's attention against the reference's: 'isolated' feeds every layer "
                            "the reference's inputs (its own error), 'end-to-end' its own (what earlier layers "
                            "passed on)" + ("" if default is None else f" (default: {default})"))
    group.add_argument("--attention-heads", type=int, default=8, metavar="N", help="query heads sampled per layer")
    group.add_argument("--attention-rows", type=int, default=16, metavar="N",
                       help="query positions sampled per turn (evenly over the reply, ends included)")


def _attention_options(args: argparse.Namespace):
    if not getattr(args, "attention", None):
        return None
    from harness.kv_paths.capture import CaptureSample
    from harness.replay.attention import AttentionOptions

    return AttentionOptions(mode=args.attention, sample=CaptureSample(args.attention_heads, args.attention_rows))


def _report(args: argparse.Namespace) -> int:
    worker = FigureWorkers.start()  # started first: their imports overlap this process's
    try:
        from harness.runs.report import render_run_report

        print(render_run_report(args.run, args.out, figure_worker=worker))
    finally:
        if worker is not None:
            worker.close()
    return 0


def _compare(args: argparse.Namespace) -> int:
    from harness.runs.compare import compare_runs, default_compare_dir
    from harness.runs.read import IncompleteRunError
    from harness.runs.status import EXIT_INCOMPLETE

    try:
        result = compare_runs(args.run_a, args.run_b, thresholds=args.threshold,
                              out_dir=args.out or default_compare_dir(args.run_a, args.run_b))
    except IncompleteRunError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INCOMPLETE
    print(result.summary_line)
    print(f"report: {result.report_path}", file=sys.stderr)
    return 1 if result.regressed else 0


def _nightly(args: argparse.Namespace) -> int:
    from harness.nightly import run_nights
    from harness.run_config import build_run_config

    from harness.kv_paths.spec import DEFAULT_PATHS

    # a night measures the reference's own precision noise beside the yardstick (the fp32 path, docs/VERDICTS.md)
    night = build_run_config(command=["harness", *sys.argv[1:]], device=args.device, models=args.model,
                             scenario_paths=args.scenarios,
                             paths=args.paths if args.paths is not None else f"{DEFAULT_PATHS},fp32")
    fields = dict(models=night.models, scenario_paths=night.scenario_paths, paths=night.paths, device=night.device,
                  command=night.command)
    nights = run_nights(args.history, fields, args.suite, args.night)
    for name, night in nights:
        prefix = "" if name == "default" else f"[{name}] "
        for model, path in night.failing:
            print(f"{prefix}VERDICT FAIL: {model} {path}")
        print(prefix + (night.compare_line or "first night: nothing to compare with"))
        if night.incomplete:
            print(f"{prefix}INCOMPLETE: {night.incomplete}", file=sys.stderr)
        print(f"{prefix}night: {night.run_dir}\n{prefix}trend: {night.trend_page}")
    return max(night.exit_code for _, night in nights)


def _export(args: argparse.Namespace) -> int:
    from harness.runs.report import export_run

    print(export_run(args.run, args.format, args.out))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from harness.run_config import single_device
    from harness.serve import serve

    serve(args.model, args.path, args.host, args.port, single_device(args.device, "serve"))
    return 0


def _raise_interrupt(signum, frame):
    """SIGTERM acts as Ctrl-C. Re-sent as SIGINT, so that inside `asyncio.run` the runner's own handler
    cancels the replay and then raises KeyboardInterrupt (rather than an exception thrown into whichever
    task was running, which leaves the others pending and prints their tracebacks)."""
    signal.raise_signal(signal.SIGINT)


def _progress(total: int):
    from tqdm import tqdm

    # smoothing=0: the ETA uses the run's average rate so far. Units differ a lot in cost (a reference
    # unit generates, a path unit also scores; models differ 2x), so a recent-rate ETA swings with each unit.
    return tqdm(total=total, unit="unit", desc="scenario x path", dynamic_ncols=True, file=sys.stderr, smoothing=0)


def _say(message: str) -> None:
    """A harness warning during the run, printed above the progress bar (never through it)."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


def _scenario_paths(args: argparse.Namespace) -> tuple[Path, ...] | None:
    """--scenarios and --tasks files (the loader reads *.jsonl as task files); None (the default set) without either."""
    for file in args.tasks or ():
        if file.suffix != ".jsonl":
            raise ValueError(f"--tasks {file}: a task file is JSON lines named *.jsonl (harness/scenarios/tasks.py)")
    return (tuple(args.scenarios or ()) + tuple(args.tasks or ())) or None


def _scenarios(args: argparse.Namespace) -> int:
    from harness.scenarios.tasks import write_yaml

    target, count = write_yaml(args.file, args.out)
    print(f"wrote {count} scenarios to {target}")
    return 0


def _run(args: argparse.Namespace) -> int:
    figure_workers: list = []  # the report's figure workers, once started; closed however the run ends
    try:
        return _run_command(args, figure_workers)
    finally:
        for worker in figure_workers:
            worker.close()


def _run_command(args: argparse.Namespace, figure_workers: list) -> int:
    from harness import job
    from harness.analysis.verdicts import parse_threshold_overrides
    from harness.executor.kernel_ledger import one_gpu
    from harness.executor.local import WorkerFailure
    from harness.executor.sharded import follow_torchrun
    from harness.lean_imports import hide_unused
    from harness.replay.tensor_parallel import torchrun_launch
    from harness.transformers_start import remember
    from harness.run_config import build_run_config
    from harness.runs.status import run_exit_code
    from harness.runs.library_log import quiet_libraries
    from harness.runs.store import RunStoreError
    from harness.replay.endpoint import PreflightError
    from harness.scenarios.load import ScenarioError
    from harness.scenarios.select import select_models

    warnings, config = [], None
    if bool(args.reference) != bool(args.candidate) and not (args.candidate and args.self_consistency):
        print("error: --reference and --candidate go together (a reference server and at least one candidate; "
              "--candidate alone with --self-consistency checks each server against itself)", file=sys.stderr)
        return 2
    if args.self_consistency and not args.candidate:
        print("error: --self-consistency checks live servers against themselves: name them with --candidate "
              "[LABEL=]URL", file=sys.stderr)
        return 2
    if args.reference or args.candidate:
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
        models = select_models(models, args.models or ())
        config = build_run_config(
            command=["harness", *sys.argv[1:]], out=args.out, device=args.device, models=models,
            scenario_paths=_scenario_paths(args), paths=args.paths, yardstick=args.yardstick, select=tuple(args.select or ()),
            history_mode=args.history_mode, resume=args.resume, calibration_paths=tuple(args.calibration or ()),
            reference_url=args.reference, candidate_urls=tuple(args.candidate or ()), judge_url=args.judge,
            judge_selection=args.judge_turns, api_key_env=args.api_key_env, tokenizer=args.tokenizer,
            jobs=args.jobs if args.jobs is not None else (os.cpu_count() or 1),
            thresholds=tuple(args.threshold or ()), attention=_attention_options(args), scales_file=args.scales,
            batch_size=args.batch_size, kernel_check_every=args.kernel_check_every, decode=args.decode,
            request_timeout_s=args.request_timeout, concurrency=args.concurrency, shard=args.shard,
            self_consistency=args.self_consistency, executor=args.executor, ray_address=args.ray_address,
            workers=args.workers, stall_timeout_s=args.stall_timeout,
            **_endpoint_config(args))
        started = time.perf_counter()
        launch = torchrun_launch()
        if launch is not None and launch[0] != 0:  # a torchrun rank other than 0: rank 0 runs the job and writes
            follow_torchrun(config)
            return 0
        if one_gpu(config) is not None:  # one GPU, replayed in this process
            _start_cuda_beside(config)
        remember()  # transformers' start-up scans, kept between runs (harness/transformers_start.py)
        hide_unused()  # transformers' torchvision and scikit-learn imports: unused here (harness/lean_imports.py)
        quiet_libraries(config.out)  # transformers' loading bars and warnings: to RUN/library.log
        figure_workers += [w for w in [FigureWorkers.start()] if w is not None]  # their imports overlap the run
        run_dir = job.run_job(config, progress=None if args.no_progress else _progress, warn=_say)
    except (PathSpecError, ScenarioError, RunStoreError, FileNotFoundError, ValueError, PreflightError) as error:
        print(f"error: {scrub_credentials(str(error))}", file=sys.stderr)
        return 2
    except WorkerFailure as error:
        print(f"error: {error}; continue with harness run --out {config.out} --resume (same arguments)",
              file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        where = f"--out {config.out} " if config else ""
        print(f"\ninterrupted: finished work is stored; continue with "
              f"harness run {where}--resume (same arguments)", file=sys.stderr)
        return 130
    _print_run_end(run_dir, time.perf_counter() - started, warnings, figure_workers[0] if figure_workers else None)
    _print_judge_problem(run_dir)
    return run_exit_code(run_dir, fail_on_verdict=not args.no_fail_on_verdict)


def _start_cuda_beside(config) -> None:
    """CUDA's start in a thread, beside the input checks' transformers imports (the run's first CUDA call took 1.5 s
    in a cProfile of the default run on an H200 box, session 31); that call waits for it (torch's lazy init is
    locked). Then, in the same thread, the plan's Triton kernels start compiling ahead of the replay, which takes
    the ledger `start_ahead` registered (harness/executor/kernel_ledger.py). A failure here is left to the run's
    first CUDA call, which raises it as before, or to its first launch of each kernel, which compiles it as before."""
    import threading

    import torch

    from harness.executor import kernel_ledger

    ledger = None
    try:
        ledger = kernel_ledger.start_ahead(config)
    except Exception as error:  # noqa: BLE001 - the run goes on, compiling at first launch as it did before
        print(f"warning: kernels not compiled ahead ({type(error).__name__}: {error})", file=sys.stderr)

    def start() -> None:
        try:
            torch.cuda.init()
            if ledger is not None:
                ledger.start()
        except Exception:  # noqa: BLE001 - said by the run's first CUDA call, where the run expects it
            pass

    threading.Thread(target=start, name="cuda-start", daemon=True).start()


def _print_run_end(run_dir: Path, seconds: float, warnings: list[str], figure_worker=None) -> list[tuple[str, str]]:
    """Print the summary (verdict matrix first); return the (model, path) pairs that failed their verdicts.
    figure_worker: where the report's figures are drawn (`harness.runs.figure_worker`; None: here)."""
    from harness import job
    from harness.runs.status import unusable_judgements
    from harness.runs.store import RunStore
    from harness.analysis.verdicts import failing_paths
    from harness.runs.summary import format_summary

    store = RunStore(run_dir)
    manifest = store.read_manifest()
    report = job.write_report(run_dir, figure_worker)
    print(format_summary(run_dir))
    for model, floor in manifest.get("noise_floor", {}).items():
        worst = max(floor.values(), default=0.0)
        state = "exactly zero" if worst == 0 else f"NONZERO (worst {worst:.3g}): bf16 path differs from reference"
        print(f"noise floor {model}: {state}")
    for warning in manifest.get("warnings", []) + warnings:
        print(f"warning: {warning}")
    unfinished = manifest.get("unfinished_units", 0)
    if unfinished:
        print(f"{unfinished} unit(s) not finished; see {run_dir / 'errors.jsonl'}; rerun with --resume to retry")
    unusable = unusable_judgements(run_dir)
    if unusable:
        print(f"{unusable} LLM judge verdict(s) gave no score; see {run_dir / 'judgements.jsonl'}")
    print(f"run {manifest['status']} in {seconds:.1f} s: {run_dir}")
    print(f"report: {report}")
    failing = failing_paths(manifest.get("verdicts") or {})
    if failing:
        print("VERDICT FAIL: " + ", ".join(f"{model} {path}" for model, path in failing)
              + " (a path failed its checks; see verdicts.jsonl)")
    return failing


def _zoo(args: argparse.Namespace) -> int:
    from harness import job
    from harness.run_config import resolve_device, stored_command
    from harness.zoo import run_zoo

    default = job.new_run_dir()
    out = args.out or default.with_name(default.name + "-zoo")
    detection = run_zoo(out, tuple(args.scenarios) if args.scenarios else None, resolve_device(args.device),
                        args.jobs, stored_command(["harness", *sys.argv[1:]]), stress=args.stress)
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


def _attention(args: argparse.Namespace) -> int:
    """`harness run` with capture on (isolated unless --attention says otherwise), then where the error is."""
    from harness import job

    args.out = args.out or job.new_run_dir()
    code = _run(args)
    attention_cli.show_attention(args.out)
    return code


COMMANDS = {"run": _run, "report": _report, "compare": _compare, "export": _export, "serve": _serve,
            "nightly": _nightly, "zoo": _zoo, "judge-scores": _judge_scores, "attention": _attention,
            "sensitivity": attention_cli.sensitivity, "calibrate": attention_cli.calibrate,
            "scenarios": _scenarios}
REPLAYS = ("run", "attention")  # commands whose interruption leaves a resumable run


def main(argv: list[str] | None = None) -> int:
    if _in_a_spawned_worker():
        print("error: harness.cli.main was called while a worker process of the run started: a worker imports the "
              "script that started the run again, and this script calls main() when imported. Put the call under "
              "`if __name__ == \"__main__\":`", file=sys.stderr)
        return 2
    args = _build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command in REPLAYS:
        signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed CI job marks its run interrupted
        # ...through SIGINT, which a shell's background job (a CI step, `cmd &`) starts with ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return COMMANDS[args.command](args)
    try:
        return COMMANDS[args.command](args)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _in_a_spawned_worker() -> bool:
    """Whether this is a spawned worker process importing its parent's script while it starts (the flag
    multiprocessing's own `_check_not_importing_main` reads). Without this, a script calling `main` unguarded ran
    again in each CPU worker, which then met the parent's run lock ("being written by another harness run"). A worker
    that calls `main` once started (`harness.families_matrix`) is not refused."""
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def entry() -> None:
    """The `harness` command (and `python -m harness.cli`): `main`, then the process ends without the interpreter's
    teardown (`_end_process`). `main` itself returns, for callers in a process of their own (tests, scripts)."""
    try:
        code = main()
    except SystemExit as done:  # argparse's --help, --version and usage errors
        code = done.code
    _end_process(code)


def _end_process(code) -> NoReturn:
    """Exit with `code` as `sys.exit` does, less the interpreter's finalisation of every module: 1.1 s after torch and
    transformers were imported (a run refused at its inputs, this project's 2-core EPYC) and 1.6 s after a default
    CUDA run (an H200 box), of a process whose work is done (BENCHMARKS.md, session 36). The atexit handlers still
    run (logging's flush, multiprocessing's joins, weakref finalizers) and the standard streams are flushed. Where a
    thread that is not a daemon is still running, or the code is not a number, the ordinary exit runs instead."""
    import atexit
    import threading

    code = 0 if code is None else code
    running = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if running or not isinstance(code, int):
        sys.exit(code)
    atexit._run_exitfuncs()  # what Py_FinalizeEx runs first; the rest of it frees memory the exit frees anyway
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`harness ... | head`), a closed stream
            pass
    os._exit(code & 0xFF)  # as the system takes a status (sys.exit(-1): 255)


if __name__ == "__main__":
    entry()
