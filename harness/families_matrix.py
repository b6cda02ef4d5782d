"""The family matrix: every causal-decoder model type the installed transformers ships (`harness.canary.registry`),
built tiny from its config class and replayed by `harness run` as a user runs it, each recorded as

- **pass**: the run completed, the bf16 noise floor is exactly zero, no unit errored, no verdict failed, and every
  FP8 path moved the logits (KL > 0 on some turn: it quantised something);
- **refused**: `harness run` exited 2 before replaying anything, naming the family and why, in the harness's words;
- **failing**: anything else: a traceback, an exit in a library's words, BF16 replayed under an FP8 name, a
  nonzero BF16 noise floor, a unit error, a timeout;
- **not built**: transformers could not build the tiny model (the reason is shown); the harness is still given
  the family's config.json and must refuse it by name (else the family is failing).

    python -m harness.families_matrix [--families T,...|--sample N] [--slow] [--part I/N] [--device cpu|cuda]
                                      [--jobs N] [--timeout S] [--results DIR] [--write-doc | --render-only]

Each family's result is DIR/<device>-<model type>.json (default DIR: docs/families); `--write-doc` renders
docs/FAMILIES.md from every result there (`render`). Without --families/--sample/--slow it runs the rotating
sample (`rotating_sample`). Each family runs in a worker process that keeps its imports (one per --jobs), with
a wall-clock limit per family (--timeout).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import multiprocessing
import re
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "tests" / "data" / "scenarios" / "families.yaml"
RESULTS = ROOT / "docs" / "families"
DOC = ROOT / "docs" / "FAMILIES.md"
PATHS = "fp8_e4m3,fp8_e4m3:per_head:calibrated"  # bf16 is always added; the calibrated path is a static scale
FP8_PATHS = tuple(PATHS.split(","))
SAMPLE = 3  # families in the rotating sample
OUTCOMES = ("pass", "refused", "failing", "not built")
SEEDS = 4  # random-weight seeds tried for a model whose first reply is not EOS at once


# -- which families ---------------------------------------------------------------------------------------------
def all_families() -> list[str]:
    from harness.canary.registry import causal_model_types

    return list(causal_model_types())


def rotating_sample(families: list[str], count: int = SAMPLE, day: datetime.date | None = None) -> list[str]:
    """Up to `count` families spread over the list, shifted by the day: every family runs within ceil(len / count)
    days, and two runs on one day run the same ones."""
    day = day or datetime.date.today()
    stride = -(-len(families) // count)
    start = day.toordinal() % stride
    return [families[i] for i in range(start, len(families), stride)]


# -- one family -------------------------------------------------------------------------------------------------
def probe_family(model_type: str, device: str = "cpu", work: Path | None = None) -> dict:
    """Build `model_type` tiny, replay it with `harness run`, and classify the outcome (the module docstring)."""
    started_cpu, started = time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        model_dir, built = _build(model_type, Path(tmp) / model_type)
        row = {"family": model_type, **built}
        row.update(_replay(model_type, model_dir, Path(tmp) / "run", device, built["built"]))
    row["cpu_s"] = round(time.process_time() - started_cpu, 1)
    row["wall_s"] = round(time.perf_counter() - started, 1)
    row["transformers"] = _transformers_version()
    if device.startswith("cuda"):
        import torch

        row["gpu"] = torch.cuda.get_device_name()
    return row


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _build(model_type: str, out: Path) -> tuple[Path, dict]:
    """The tiny model saved to `out` (bf16, canary tokenizer), and whether transformers alone generates with it.
    A family transformers cannot build gets its config.json (the tiny one, else the default) and the tokenizer."""
    import torch

    from harness.canary import registry
    from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER
    from harness.canary.tokenizer import save_tokenizer

    out.mkdir(parents=True)
    save_tokenizer(out)
    (out / RANDOM_WEIGHTS_MARKER).write_text("random weights, seed 0: outputs are noise\n")
    facts: dict = {"model_class": registry.causal_model_types().get(model_type)}
    config = None
    try:
        config = registry.tiny_config(model_type)
        for seed in range(SEEDS):  # random weights that end the first reply at once measure nothing: the next seed
            torch.manual_seed(seed)
            model = registry.build_model(model_type, config).to(torch.bfloat16).eval()
            if not _replies_eos_first(model):
                break
    except Exception as error:  # noqa: BLE001 - recorded as the reason it was not built
        facts.update(built=False, build_error=_short(error))
        _write_config(model_type, config, out)
        return out, facts
    facts.update(built=True, seed=seed, parameters=sum(p.numel() for p in model.parameters()),
                 transformers_generates=_generates(model))
    model.save_pretrained(str(out))
    return out, facts


def _write_config(model_type: str, config, out: Path) -> None:
    """The config and an empty weights file, so that loading gets as far as building the model (as a user's
    checkpoint of the family would)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    try:
        config = config or AutoConfig.for_model(model_type)
        config.save_pretrained(str(out))
    except Exception:  # noqa: BLE001 - even the default config will not build: its bare model type
        (out / "config.json").write_text(json.dumps({"model_type": model_type}) + "\n")
    save_file({}, str(out / "model.safetensors"))


def _replies_eos_first(model) -> bool:
    """Whether the model's greedy first token after the scenario's first prompt is the tokenizer's EOS."""
    import torch

    from harness.canary.tokenizer import build_tokenizer
    from harness.forward_context import forward_context

    tokenizer = build_tokenizer()
    chat = [{"role": "system", "content": "End every answer with the word Thanks."},
            {"role": "user", "content": "What plans do you offer?"}]  # tests/data/scenarios/families.yaml, turn 1
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    try:
        with torch.inference_mode(), forward_context():
            logits = model(input_ids=torch.tensor([list(ids)])).logits
    except Exception:  # noqa: BLE001 - a forward that fails is the harness's to refuse, not the seed's
        return False
    return int(logits[0, -1].argmax()) == tokenizer.eos_token_id


def _generates(model) -> str:
    """'yes', or transformers' own error generating 4 tokens after a 40-token prompt (its default attention)."""
    import torch

    from harness.forward_context import forward_context

    try:
        with torch.inference_mode(), forward_context():
            model.generate(torch.arange(3, 43)[None] % 100 + 3, max_new_tokens=4, do_sample=False)
        return "yes"
    except Exception as error:  # noqa: BLE001
        return _short(error)


def _replay(model_type: str, model_dir: Path, out: Path, device: str, built: bool) -> dict:
    from harness.cli import main

    argv = ["run", "--model", str(model_dir), "--scenarios", str(SCENARIOS), "--calibration", str(SCENARIOS),
            "--paths", PATHS, "--out", str(out), "--no-progress", "--device", device, "--jobs", "1",
            "--yardstick", "none"]
    if device != "cpu":
        argv += ["--decode", "graph"]
    stderr, stdout = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            code = main(argv)
    except BaseException as error:  # noqa: BLE001 - a traceback out of `harness run` is the finding
        if isinstance(error, KeyboardInterrupt):
            raise
        return {"outcome": "failing", "exit": None,
                "problems": [f"traceback: {_short(error)} at {_where(error)}"]}
    said = stderr.getvalue().replace(str(model_dir), "MODEL").strip()
    return _classify(model_type, code, said, out, built)


def _classify(model_type: str, code: int, said: str, out: Path, built: bool) -> dict:
    from harness.runs.store import RunStore

    records = RunStore(out).read("records") if out.exists() else []
    errors = said.splitlines()
    reason = next((line.removeprefix("error: ") for line in errors if line.startswith("error: ")), said[-300:])
    if code == 2:
        # a composite model's refusal may name its decoder's config (mllama -> 'mllama_text_model')
        named = re.search(rf"model family '{re.escape(model_type)}[a-z_]*'", reason) is not None
        ours = named and "Traceback" not in said
        if ours and not records:
            return {"outcome": "not built" if not built else "refused", "exit": 2, "reason": reason}
        return {"outcome": "failing", "exit": 2, "reason": reason,
                "problems": [f"exit 2 in a library's words: {reason}" if not ours else
                             f"refused after {len(records)} records were written"]}
    if not built:
        return {"outcome": "failing", "exit": code, "problems": ["not built, yet `harness run` did not refuse it"]}
    return {"exit": code, **_judge_run(out, code)}


def _judge_run(out: Path, code: int) -> dict:
    from harness.runs.store import RunStore

    store = RunStore(out)
    manifest = json.loads((out / "manifest.json").read_text())
    label = next(iter(manifest.get("noise_floor") or {}), None)
    problems = [f"exit {code}"] if code not in (0, 1) else []
    problems += [f"unit error: {e.get('error', e)}"[:300] for e in store.read("errors")]
    floor = (manifest.get("noise_floor") or {}).get(label)
    if not floor or any(value for value in floor.values()):
        problems.append(f"bf16 noise floor not exactly zero: {floor}")
    failed = [v for v in store.read("verdicts") if v.get("verdict") == "fail"]
    problems += [f"verdict fail: {v['path']} turn {v['turn']}: {v['reasons']}"[:300] for v in failed]
    records = store.read("records")
    for path in FP8_PATHS:
        kl = [r["value"] for r in records if r["path"] == path and r["metric"] == "kl_max" and r["value"] is not None]
        if not kl:
            problems.append(f"{path}: no KL measured (no generated token to compare)")
        elif not max(kl) > 0:
            problems.append(f"{path}: KL to the reference is 0 on every turn: BF16 under an FP8 name")
    facts = (manifest.get("families") or {}).get(label, {})
    return {"outcome": "failing" if problems else "pass", "problems": problems,
            "attention": facts.get("attention"), "fp8_layers": facts.get("fp8_layers"),
            "kept_bf16": facts.get("kept_bf16"), "decode_kernels": facts.get("decode_kernels", ""),
            "graph_decode": facts.get("graph_decode", ""), "batching": (manifest.get("batching") or {}).get(label)}


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip()}"[:400]


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


# -- many families: worker processes with a wall-clock limit each ------------------------------------------------
def _worker(model_type: str, device: str, timeout: int) -> dict:
    def expire(signum, frame):
        raise TimeoutError(f"over {timeout} s wall clock")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(timeout)
    started = time.process_time()
    try:
        return probe_family(model_type, device)
    except TimeoutError as error:
        return {"family": model_type, "outcome": "failing", "problems": [str(error)],
                "cpu_s": round(time.process_time() - started, 1)}
    finally:
        signal.alarm(0)


def _quiet_worker() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()


def _commit() -> str | None:
    import subprocess

    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def run_matrix(families: list[str], device: str, jobs: int, timeout: int, results: Path) -> list[dict]:
    results.mkdir(parents=True, exist_ok=True)
    commit = _commit()
    rows = []
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(jobs, initializer=_quiet_worker, maxtasksperchild=25)
    try:
        waiting = [(family, pool.apply_async(_worker, (family, device, timeout))) for family in families]
        for family, result in waiting:
            try:
                row = result.get(timeout + 120)
            except Exception as error:  # noqa: BLE001 - a worker that died (segfault, out of memory)
                row = {"family": family, "outcome": "failing", "problems": [f"worker died: {_short(error)}"]}
            row["device"], row["commit"] = device, commit
            (results / f"{device}-{family}.json").write_text(json.dumps(row, indent=1, default=str) + "\n")
            rows.append(row)
            print(f"{family:32s} {row['outcome']:9s} {row.get('cpu_s', '?'):>6} s  "
                  f"{(row.get('problems') or [row.get('reason') or row.get('build_error') or ''])[0][:110]}",
                  flush=True)
    finally:
        pool.close()  # not terminate(): a worker's `harness run` turns SIGTERM into an interrupt
        pool.join()
    return rows


# -- the page ---------------------------------------------------------------------------------------------------
def load_results(results: Path = RESULTS) -> dict[str, dict[str, dict]]:
    """{device: {model type: row}} from RESULTS/<device>-<model type>.json."""
    found: dict[str, dict[str, dict]] = {"cpu": {}, "cuda": {}}
    for file in sorted(Path(results).glob("*.json")):
        device, _, family = file.stem.partition("-")
        if device in found:
            found[device][family] = json.loads(file.read_text())
    return found


def render(found: dict[str, dict[str, dict]], families: list[str], version: str) -> str:
    cpu = found["cpu"]
    counts = {o: sum(1 for f in families if (cpu.get(f) or {}).get("outcome") == o) for o in OUTCOMES}
    seconds = sorted(row["cpu_s"] for row in cpu.values() if isinstance(row.get("cpu_s"), (int, float)))
    lines = [
        "# Model families", "",
        f"Generated by `python -m harness.families_matrix --slow --write-doc` (do not edit by hand) from "
        f"`docs/families/*.json`: **{len(families)} causal-decoder model types in transformers {version}** (the "
        f"model types of `AutoModelForCausalLM`'s mapping, plus those with a `...ForCausalLM` class of their own; "
        f"`harness/canary/registry.py`).", "",
        "Each family is a tiny random-weight model built from its own config class (its defaults: layer types, "
        "windows, indexer, experts, per-layer head sizes; every size shrunk: hidden 64, 4 heads of 16, 4 layers "
        "keeping each kind of layer, the canary tokenizer's 128 tokens), replayed by `harness run --paths "
        f"{PATHS}` (bf16 added) on one two-turn chat (`tests/data/scenarios/families.yaml`), `--jobs 1`.", "",
        "**pass**: completed, bf16 noise floor exactly zero, no unit error, no verdict failed, every FP8 path moved "
        "the logits (KL > 0). **refused**: exit 2 before any replay, naming the family, in the harness's words. "
        "**failing**: a traceback, an exit in a library's words, BF16 under an FP8 name, a nonzero noise floor, a "
        "unit error, or a timeout. **not built**: transformers could not build the tiny model (why is shown) and "
        "`harness run` refused its config by name.", "",
        f"CPU: {counts['pass']} pass, {counts['refused']} refused, {counts['failing']} failing, "
        f"{counts['not built']} not built, {len(families) - sum(counts.values())} not run"
        + (f"; CPU seconds per family (build + replay, one process per worker, imports paid once): median "
           f"{seconds[len(seconds) // 2]}, max {seconds[-1]}" if seconds else "") + ".", "",
        *_cuda_summary(found["cuda"], families),
        "| model type | class | attention | CPU | CPU s | CUDA | CUDA graph | kernels | why / notes |",
        "|---|---|---|---|---|---|---|---|---|"]
    for family in families:
        row, gpu = cpu.get(family) or {}, found["cuda"].get(family) or {}
        cells = [family, row.get("model_class") or "", ", ".join(row.get("attention") or gpu.get("attention") or []),
                 row.get("outcome", "not run"), str(row.get("cpu_s", "")), gpu.get("outcome", "not run"),
                 _graph(gpu), _kernels(gpu), _why(row, gpu)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines.append("")
    return "\n".join(lines)


def _cuda_summary(cuda: dict[str, dict], families: list[str]) -> list[str]:
    """The CUDA column's line: its machine and transformers (the GPU machines may have another version, with
    another registry: its model types not on this page are counted, this page's types it lacks are not run)."""
    if not cuda:
        return []
    counts = {o: sum(1 for row in cuda.values() if row.get("outcome") == o) for o in OUTCOMES}
    where = sorted({f"{row.get('gpu') or 'GPU not recorded'}, transformers {row.get('transformers') or '?'}"
                    for row in cuda.values()})
    graph = sum(1 for row in cuda.values() if _graph(row) == "on")
    kernels = sum(1 for row in cuda.values() if _kernels(row) == "on")
    absent = sum(1 for f in families if f not in cuda)
    return [f"CUDA ({'; '.join(where)}): {len(cuda)} model types, {counts['pass']} pass, {counts['refused']} "
            f"refused, {counts['failing']} failing, {counts['not built']} not built; of those passing, {graph} decode "
            f"in CUDA graphs and {kernels} through our decode kernels. {absent} of this page's types are not in "
            f"that transformers (CUDA: not run).", ""]


def _kernels(row: dict) -> str:
    if not row or row.get("outcome") != "pass":
        return ""
    return row.get("decode_kernels") or "on"


def _graph(row: dict) -> str:
    if not row or row.get("outcome") != "pass":
        return ""
    return row.get("graph_decode") or "on"


def _why(cpu: dict, gpu: dict) -> str:
    notes = []
    for row in (cpu, gpu):
        if row.get("outcome") in ("refused", "not built"):
            notes.append(row.get("reason") or "")
        if row.get("build_error"):
            notes.append(f"not built: {row['build_error']}")
        notes += row.get("problems") or []
    return "; ".join(dict.fromkeys(n for n in notes if n))[:600]


def _cell(value: str) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def write_doc(results: Path = RESULTS, out: Path = DOC) -> Path:
    import transformers

    out.write_text(render(load_results(results), all_families(), transformers.__version__))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.families_matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated model types (default: the rotating sample)")
    parser.add_argument("--sample", type=int, default=SAMPLE, help="families in the rotating sample")
    parser.add_argument("--slow", action="store_true", help="every family")
    parser.add_argument("--part", default="1/1", help="I/N: the I-th of N equal slices of the families (one per GPU, "
                                                      "each process under its own CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--timeout", type=int, default=600, help="wall-clock seconds per family")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--write-doc", action="store_true", help="render docs/FAMILIES.md from --results")
    parser.add_argument("--render-only", action="store_true", help="only render docs/FAMILIES.md from --results")
    args = parser.parse_args(argv)
    if args.render_only:
        print(f"wrote {write_doc(args.results)}")
        return 0
    known = all_families()
    if args.families:
        families = args.families.split(",")
        unknown = [f for f in families if f not in known]
        if unknown:
            print(f"error: --families: not causal-decoder model types of this transformers: {', '.join(unknown)}",
                  file=sys.stderr)
            return 2
    else:
        families = known if args.slow else rotating_sample(known, args.sample)
    try:
        part, parts = (int(x) for x in args.part.split("/"))
        assert 1 <= part <= parts
    except (ValueError, AssertionError):
        print(f"error: --part: expected I/N with 1 <= I <= N, got {args.part!r}", file=sys.stderr)
        return 2
    families = families[part - 1::parts]
    rows = run_matrix(families, args.device, args.jobs, args.timeout, args.results)
    counts = {o: sum(1 for r in rows if r["outcome"] == o) for o in OUTCOMES}
    print(", ".join(f"{n} {o}" for o, n in counts.items()) + f" of {len(rows)}")
    if args.write_doc:
        print(f"wrote {write_doc(args.results)}")
    return 1 if counts["failing"] else 0


if __name__ == "__main__":
    sys.exit(main())
