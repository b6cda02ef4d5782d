"""`harness attention`, `harness sensitivity`, `harness calibrate`: where an FP8 path's attention goes wrong,
which layers to keep in BF16, and scales to ship.

  harness attention [run options]         `harness run --attention isolated` plus an attention summary
(subcommands of the one `harness` parser, harness/cli.py)
  harness sensitivity --model DIR         FP8 on one attention layer at a time; ranking + precision map
  harness calibrate --model DIR --out D   k_scale/v_scale (and q/prob) files engines load
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def add_calibrate_options(parser: argparse.ArgumentParser) -> None:
    """`harness calibrate`'s options (the CLI adds --device)."""
    parser.add_argument("--model", type=Path, required=True, metavar="DIR", help="local transformers model directory")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the files go")
    parser.add_argument("--calibration", action="append", type=Path, metavar="PATH",
                        help="scenario file(s) whose chats calibrate (default: the built-in set)")
    parser.add_argument("--granularity", choices=["per_tensor", "per_head"], default="per_tensor",
                        help="one scale per layer (per_tensor, default) or per KV head")
    parser.add_argument("--format", choices=["e4m3", "e5m2"], default="e4m3", help="FP8 format the scales are for")
    parser.add_argument("--shape", choices=["scalar", "one"], default="scalar",
                        help="a per-tensor scale as shape [] (scalar) or [1] (one)")
    parser.add_argument("--attention-scales", action="store_true",
                        help="also q_scale and prob_scale (FP8 attention paths)")


def add_sensitivity_options(parser: argparse.ArgumentParser) -> None:
    """`harness sensitivity`'s options (the CLI adds --device)."""
    parser.add_argument("--model", type=Path, required=True, metavar="DIR", help="local transformers model directory")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where the files go (default: runs/sensitivity-<model>)")
    parser.add_argument("--path", default="fp8_e4m3", metavar="SPEC", help="the FP8 path to scan (default: fp8_e4m3)")
    parser.add_argument("--scenarios", action="append", type=Path, metavar="PATH",
                        help="scenario file or directory (default: scenarios/canary/*.yaml)")
    parser.add_argument("--max-turns", type=int, default=6, metavar="N", help="turns replayed per measurement")
    parser.add_argument("--budget", type=float, metavar="KL",
                        help="teacher-forced kl_mean the mixed path may reach (default: half the all-FP8 path's)")
    parser.add_argument("--bisect-above", type=int, default=16, metavar="N",
                        help="bisect over groups when the model has more attention layers than this")
    parser.add_argument("--scales", type=Path, metavar="FILE", help="scales file for ':checkpoint' paths")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---------------------------------------------------------------- calibrate


def calibrate(args: argparse.Namespace) -> int:
    from harness import job
    from harness.kv_paths import calibration
    from harness.kv_paths.spec import parse_path
    from harness.replay.inprocess import InProcessModel
    from harness.scenarios.sources import load_scenarios

    from harness.run_config import single_device

    loaded = InProcessModel.load(args.model, device=single_device(args.device, "calibrate"))
    if args.calibration:
        loaded.calibration_chats = job.calibration_chats_from(load_scenarios(list(args.calibration)))
    spec = f"fp8_{args.format}:{args.granularity}:calibrated" + (":fp8_q:fp8_p" if args.attention_scales else "")
    scales = loaded.scales_for(parse_path(spec))
    tables = {"k_scale": scales.k, "v_scale": scales.v}
    if args.attention_scales:
        tables |= {"q_scale": scales.q, "prob_scale": scales.prob}
    chats = len(loaded.calibration_chats) or len(calibration.default_calibration_chats())
    files = calibration.write_scale_files(args.out, tables, loaded.model.config, args.format, args.shape,
                                          metadata={"calibration": scales.provenance, "path": spec,
                                                    "model": str(args.model), "chats": chats})
    names = list(tables)
    print(f"{'layer':>5}  " + "  ".join(f"{n:>22}" for n in names))
    for layer in sorted(scales.k):
        cells = [_scale_text(tables[n].get(layer)) for n in names]
        print(f"{layer:>5}  " + "  ".join(f"{c:>22}" for c in cells))
    print(f"scales: amax / {args.format} max over {chats} calibration chats ({args.granularity})"
          + ("; MLA: one scale per latent cache" if loaded.is_mla else ""))
    for file in files:
        print(f"wrote {file}")
    print(f"use: harness run --model {args.model} --paths fp8_{args.format}:{args.granularity}:checkpoint "
          f"--scales {files[0]}")
    return 0


def _scale_text(value) -> str:
    if value is None:
        return "-"
    flat = value.float().reshape(-1)
    return f"{flat.item():.6g}" if flat.numel() == 1 else f"[{flat.min().item():.3g}..{flat.max().item():.3g}] x{flat.numel()}"


# ---------------------------------------------------------------- sensitivity


def sensitivity(args: argparse.Namespace) -> int:
    from harness import job
    from harness.kv_paths.cache import attention_layer_indices
    from harness.kv_paths.spec import parse_path
    from harness.replay import sensitivity as scan
    from harness.replay.inprocess import InProcessModel
    from harness.scenarios.sources import load_scenarios

    kv_path = parse_path(args.path)
    if not kv_path.is_quantized and not kv_path.quantizes_attention:
        raise ValueError(f"--path {args.path!r} quantises nothing; scan an FP8 path, e.g. fp8_e4m3")
    scenarios = load_scenarios(list(args.scenarios or job.default_scenarios()))
    from harness.run_config import single_device

    loaded = InProcessModel.load(args.model, device=single_device(args.device, "sensitivity"))
    loaded.scales_file = args.scales
    layers = attention_layer_indices(loaded.model.config)
    out = args.out or Path("runs") / f"sensitivity-{job.model_label(args.model)}"
    out.mkdir(parents=True, exist_ok=True)
    bar = None if args.no_progress else _bar(len(layers) + 2)
    note = (lambda m: bar.update(1)) if bar else None
    turns = scan.reference_turns(loaded, scenarios, args.max_turns)
    if not turns:
        raise ValueError("the scenarios gave no generated turn to measure")
    all_fp8 = scan.measure(loaded, scan.with_fp8_layers(kv_path, layers, layers), turns, layers)
    note and note(all_fp8)
    budget = args.budget if args.budget is not None else all_fp8.kl_mean / 2
    source = "--budget" if args.budget is not None else f"half the all-FP8 path's kl_mean ({all_fp8.kl_mean:.4g})"
    ranking = scan.scan(loaded, kv_path, turns, args.bisect_above, floor=budget / max(len(layers), 1),
                        on_measured=note)
    bf16, mixed = scan.recommend(loaded, kv_path, turns, ranking, budget, on_measured=note)
    if bar:
        bar.close()
    body = scan.precision_map(job.model_label(args.model), kv_path, budget, bf16, layers, mixed, all_fp8, ranking, source)
    map_file = out / "sensitivity.json"
    map_file.write_text(json.dumps(body, indent=1) + "\n")
    from reports import attention_plots

    attention_plots.sensitivity_ranking(body, out)
    _print_sensitivity(body, len(turns))
    print(f"wrote {map_file} (and sensitivity_layers.png)")
    print(f"use: harness run --model {args.model} --paths {kv_path.name},{kv_path.name}:layers={map_file}")
    return 0


def _bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="config", desc="sensitivity", dynamic_ncols=True, file=sys.stderr)


def _print_sensitivity(body: dict, turns: int) -> None:
    print(f"layer sensitivity of {body['kv_path']} on {body['model']} ({turns} turns, FP8 on the listed layers only)")
    print(f"{'layers':>10} {'kl_mean':>10} {'kl_max':>10} {'first_div':>9} {'diverged':>9}")
    for row in body["ranking"]:
        first = "-" if row["first_divergent_token"] is None else str(row["first_divergent_token"])
        layers = "+".join(map(str, row["fp8_layers"]))
        print(f"{layers:>10} {row['kl_mean']:>10.4g} {row['kl_max']:>10.4g} {first:>9} "
              f"{row['diverged_turns']:>4}/{row['turns']:<4}")
    mixed, every = body["measured"]["mixed"], body["measured"]["all_fp8"]
    print(f"budget kl_mean <= {body['budget']['limit']:.4g} ({body['budget']['source']})")
    print(f"all FP8: kl_mean {every['kl_mean']:.4g}; keep in BF16 {body['bf16_layers'] or 'none'}: "
          f"kl_mean {mixed['kl_mean']:.4g} (measured)")
    print("per-layer format: " + ", ".join(f"{layer} {fmt}" for layer, fmt in body["layers"].items()))
    for engine, flags in body.get("engine_flags", {}).items():
        print(f"{engine}: {flags}")


# ---------------------------------------------------------------- attention


def show_attention(run_dir: Path) -> None:
    """After `harness attention`'s run: the one-screen attention summary and the views under RUN/attention/. The
    run is stored whatever happens here: a file that cannot be read is named, and the views are skipped."""
    from harness.runs.read import RunReadError, RunView

    run = RunView(run_dir)
    if not run.has("attention"):  # the run captured none (or stopped before writing any)
        return
    try:
        print(format_attention_summary(run.records))
        parts = run.attention_frame, run.attention_channels_frame, run.sensitivity
    except RunReadError as error:
        print(f"attention summary skipped: {error}", file=sys.stderr)
        return
    from reports import attention_plots

    for figure in attention_plots.run_figures(*parts, run_dir / "attention"):
        print(f"view: {run_dir / 'attention' / figure['file']}")


def format_attention_summary(records: list[dict]) -> str:
    """Per model and path (a run's records.jsonl rows): worst layer and head, max/mean output error, KL, growth
    with context."""
    wanted = ("attn_out_rel_err_max", "attn_out_rel_err_mean", "attn_kl_max", "attn_topk_overlap_min",
              "attn_growth_per_1k", "attn_worst_layer", "attn_worst_head", "attn_worst_head_layer",
              "attn_worst_layer_err", "attn_kernel_out_rel_err_max", "attn_kernel_out_rel_err_mean",
              "attn_kernel_vs_torch_max", "attn_kernel_lse_err_max")
    table: dict[tuple[str, str], dict[str, list]] = {}
    for row in records:
        if row["metric"] in wanted:
            value = row["value"] if row["value"] is not None else math.inf
            table.setdefault((row["model"], row["path"]), {}).setdefault(row["metric"], []).append(value)
    lines = ["attention-score error (worst over turns; out_err = ||o_path - o_ref|| / ||o_ref||)",
             f"{'model':<10} {'path':<38} {'out_err max':>11} {'mean':>8} {'attn KL max':>11} {'top8 min':>8} "
             f"{'growth/1k':>9}  worst layer (head)"]
    for (model, path), values in table.items():
        def worst(name, pick=max):
            return pick(values[name]) if values.get(name) else math.nan

        mean = sum(values.get("attn_out_rel_err_mean", [math.nan])) / max(len(values.get("attn_out_rel_err_mean", [])), 1)
        # the worst layer of the turn with the largest worst-layer error
        errs = values.get("attn_worst_layer_err", [])
        at = errs.index(max(errs)) if errs else None
        where = "-" if at is None else (f"L{int(values['attn_worst_layer'][at])} "
                                        f"(L{int(values['attn_worst_head_layer'][at])} h{int(values['attn_worst_head'][at])})")
        lines.append(f"{model:<10} {path[:38]:<38} {worst('attn_out_rel_err_max'):>11.4g} {mean:>8.4g} "
                     f"{worst('attn_kl_max'):>11.4g} {worst('attn_topk_overlap_min', min):>8.3g} "
                     f"{worst('attn_growth_per_1k'):>9.3g}  {where}")
        if values.get("attn_kernel_out_rel_err_max"):  # the path's decode kernel, run on the same rows
            kernel_mean = _mean(values["attn_kernel_out_rel_err_mean"])
            lse = f", lse err max {worst('attn_kernel_lse_err_max'):.3g}" if values.get("attn_kernel_lse_err_max") else ""
            lines.append(f"{'':<10} {'  its decode kernel':<38} {worst('attn_kernel_out_rel_err_max'):>11.4g} "
                         f"{kernel_mean:>8.4g}  vs torch on the same codes: max {worst('attn_kernel_vs_torch_max'):.3g}"
                         f"{lse}")
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
