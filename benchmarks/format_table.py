"""Per KV format, what a stored run measured (issue 41's BENCHMARKS table), one row per model and path:

    python benchmarks/format_table.py RUN [RUN ...]

bytes per token (one attention layer's cache, K and V over every KV head; MLA: the latent row as
`cache.latent_row_formats` stores it), the path's pooled kl_mean and its ratio to the yardstick (raw, and as the
gate reads it, floored at KL_RATIO_FLOOR), task recovery (reference-right items the path kept, over every task
check), the write check's worst turn (`kv_write_err_ratio`: 1 = the format's own write), failing / warning turns,
and the per-path verdict with its failing checks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.kv_paths.cache import latent_row_formats
from harness.kv_paths.spec import parse_path
from harness.runs.read import read_run


def bytes_per_token(spec: str, config) -> float | None:
    """One attention layer's K and V bytes per token (bf16: 2 bytes a value); None for a path that is no cache."""
    path = parse_path(spec)
    if path.is_reference_noise:
        return None
    rank = getattr(config, "kv_lora_rank", None)
    if rank is not None:  # MLA: one latent row [latent | k_pe]
        rope = int(config.qk_rope_head_dim)
        if not path.is_quantized:
            return 2.0 * (rank + rope)
        latent, rope_format = latent_row_formats(path)
        return latent.bytes_per_token(rank) + (rope_format.bytes_per_token(rope) if rope_format else 2.0 * rope)
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    if not path.is_quantized:
        return 2.0 * 2 * heads * head_dim
    return path.k_format.bytes_per_token(head_dim, heads) + path.v_format.bytes_per_token(head_dim, heads)


def recovery(numbers: dict) -> str:
    kept = right = 0
    for name, value in numbers.items():
        if name.endswith("_recovery") and isinstance(value, dict):
            right += value.get("reference_right", 0)
            kept += value.get("reference_right", 0) - value.get("lost", 0)
    return f"{kept}/{right}" if right else "-"


def _lines(run_dir: Path) -> list[str]:
    from transformers import AutoConfig

    run = read_run(run_dir)
    manifest = run.manifest
    configs = {m["label"]: AutoConfig.from_pretrained(m["path"]) for m in manifest["models"]}
    writes: dict[tuple, float] = {}
    for row in run.records:
        if row.get("metric") == "kv_write_err_ratio" and isinstance(row.get("value"), (int, float)):
            key = (row["model"], row["path"])
            writes[key] = max(writes.get(key, 0.0), row["value"])
    turns: dict[tuple, list[str]] = {}
    for row in run.verdicts:
        turns.setdefault((row["model"], row["path"]), []).append(row["verdict"])
    out = [f"## {run_dir} ({manifest.get('device')}, {manifest.get('cpu', '')}, yardstick {manifest.get('yardstick')})",
           "| model | path | bytes/token/layer | x bf16 | kl_mean (nats) | / yardstick | gate ratio | task kept | "
           "write check | turns fail / warn | path verdict |", "|---|---|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for row in sorted(run.path_verdicts, key=lambda r: (r["model"], r["path"])):
        if row.get("role"):  # the twin, the control arm, the fp32 reference: measured beside, not candidates
            continue
        numbers, model, path = row.get("numbers") or {}, row["model"], row["path"]
        size, bf16 = bytes_per_token(path, configs[model]), bytes_per_token("bf16", configs[model])
        kl, stick = numbers.get("kl_mean"), numbers.get("yardstick_kl_mean")
        raw = f"{kl / stick:.3g}" if kl is not None and stick else "-"
        gate = f"{numbers['kl_mean_ratio']:.3g}" if numbers.get("kl_mean_ratio") is not None else "-"
        failing = [r.get("metric") or r["check"] for r in row.get("reasons", []) if r["severity"] == "fail"]
        verdicts = turns.get((model, path), [])
        write = f"{writes[(model, path)]:.4g}" if (model, path) in writes else "-"
        out.append(f"| {model} | `{path}` | {size:g} | {size / bf16:.3f} | {kl if kl is None else f'{kl:.3g}'} | "
                   f"{raw} | {gate} | {recovery(numbers)} | {write} | {verdicts.count('fail')} / "
                   f"{verdicts.count('warn')} | {row['verdict']}{' (' + ', '.join(failing) + ')' if failing else ''} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    for run_dir in parser.parse_args().runs:
        print("\n".join(_lines(run_dir)))


if __name__ == "__main__":
    main()
