"""Write `tests/data/runs/real/` from an actual `harness run`, so the report's reader and the run's writer
cannot drift apart (the synthetic runs of `make_runs.py` are checked against its file and column names).

`python tests/data/make_real_run.py` (3 to 6 minutes on 2 shared CPU cores): two bundled canaries (MLA and the
hybrid), one scenario of each kind, the reference, bf16 and two FP8 paths, one of which (`fp8_e4m3:warmup`)
breaks the hybrid. `library.log` is dropped (it names local paths); everything else is kept as written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "runs" / "real"
ARGS = ["--models", "mla,hybrid", "--paths", "fp8_e5m2,fp8_e4m3:warmup",
        "--select", "id:canary-arith-1,id:canary-recall-1,id:canary-chat-1,id:canary-needle-1"]


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "harness.cli", "run", *ARGS, "--out", str(OUT), "--no-progress"],
                   cwd=ROOT, env=env, check=False)
    (OUT / "library.log").unlink(missing_ok=True)
    (OUT / ".lock").unlink(missing_ok=True)
    shutil.rmtree(OUT / "report", ignore_errors=True)  # rendered by the tests, not stored
    assert (OUT / "verdicts.jsonl").exists(), "the run wrote no verdicts.jsonl"
    manifest = json.loads((OUT / "manifest.json").read_text())
    manifest["command"] = "harness run " + " ".join(ARGS)  # the real command, without this machine's paths
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{OUT}: {sum(f.stat().st_size for f in OUT.rglob('*') if f.is_file()) // 1024} KiB")


if __name__ == "__main__":
    main()
