"""Print where a run's attention error is: mean attn_out_rel_err per layer and per context bucket, per path.

    python benchmarks/attention_tables.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from harness.analysis.attention_error import key_bucket_labels


def tables(run_dir: Path) -> str:
    rows = pd.DataFrame([json.loads(line) for line in (run_dir / "attention.jsonl").read_text().splitlines()])
    rows["attn_out_rel_err"] = pd.to_numeric(rows["attn_out_rel_err"], errors="coerce")
    if "attention" in rows:  # a decode kernel's rows are their own series: PATH [kernel:NAME]
        kernel = rows["attention"].fillna("torch") != "torch"
        rows.loc[kernel, "path"] = rows.loc[kernel, "path"] + " [" + rows.loc[kernel, "attention"] + "]"
    out = [f"## {run_dir.name}: mean attn_out_rel_err by layer (rows: path)"]
    out.append(rows.pivot_table(index="path", columns="layer", values="attn_out_rel_err", aggfunc="mean")
               .to_string(float_format=lambda v: f"{v:.4f}"))
    edges = [0, 64, 128, 256, 512, 1024, 2048, 4096, 1 << 20]
    rows["context_bucket"] = pd.cut(rows["context"], edges, right=True).astype(str)
    out.append(f"\n## {run_dir.name}: mean attn_out_rel_err by context length (keys attended)")
    out.append(rows.pivot_table(index="path", columns="context_bucket", values="attn_out_rel_err", aggfunc="mean",
                                sort=False).to_string(float_format=lambda v: f"{v:.4f}"))
    if "attn_dp_by_key_pos" in rows:
        moved = rows[rows["attn_dp_by_key_pos"].map(lambda v: isinstance(v, list) and bool(v))]
        width = max(len(v) for v in moved["attn_dp_by_key_pos"])
        padded = pd.DataFrame([v + [0.0] * (width - len(v)) for v in moved["attn_dp_by_key_pos"]], index=moved.index)
        padded.columns = key_bucket_labels(width)
        out.append(f"\n## {run_dir.name}: mean probability mass moved by key position (sum of |dp| per bucket)")
        out.append(padded.groupby(moved["path"]).mean().to_string(float_format=lambda v: f"{v:.2e}"))
    if "attn_kernel_vs_torch" in rows:
        kernel = rows[rows["attention"].fillna("torch") != "torch"]
        out.append(f"\n## {run_dir.name}: decode kernel against torch over the same stored codes (max over rows)")
        out.append(kernel.groupby("path")[[c for c in ("attn_kernel_vs_torch", "attn_kernel_lse_err") if c in kernel]]
                   .max().to_string(float_format=lambda v: f"{v:.3g}"))
    channels = run_dir / "attention_channels.jsonl"
    if channels.is_file():
        ch = pd.DataFrame([json.loads(line) for line in channels.read_text().splitlines()])
        if "clipped_channels" in ch:
            out.append(f"\n## {run_dir.name}: channels above scale x fp8 max (max over turns)")
            out.append(ch.pivot_table(index=["path", "tensor"], columns="layer", values="clipped_channels",
                                      aggfunc="max").to_string())
    return "\n".join(out)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(tables(Path(arg)))
        print()
