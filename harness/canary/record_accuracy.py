"""Write the accuracy that a stored `harness run` measured into each canary's model card.

    harness run --model harness/canary/weights/gqa ... --scenarios scenarios/canary/accuracy --paths bf16 --out RUN
    python -m harness.canary.record_accuracy RUN [RUN ...] [--weights harness/canary/weights]

A scenario counts as correct when every scored turn is: the answer turn of arithmetic, recall and needle
scenarios (`answer_correct`), and every reply of a rule chat (`rules_followed`). The numbers are the
reference's (bf16 cache) replies. Several runs (e.g. a stress set and the default scenarios) give one table
each in the same section. The card's section between the markers below is replaced, so running this again
after a retrain leaves one.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd
import yaml

from harness.runs.store import RunStore
from harness.runs.summary import records_frame

BEGIN = "<!-- accuracy measured by harness run: begin -->"
END = "<!-- accuracy measured by harness run: end -->"
TARGETS = {"arithmetic": 0.95, "recall": 0.95, "long_context": 0.90, "chat": 0.90}  # issue 3
KIND_TITLES = {"arithmetic": "arithmetic", "recall": "recall", "long_context": "needle", "chat": "rule chats"}
REPO_ROOT = Path(__file__).resolve().parents[2]
ACCURACY_SET = "scenarios/canary/accuracy/"


def accuracy_by_model(run_dir: Path) -> pd.DataFrame:
    """Rows (model, kind): correct scenarios, scenarios, fraction; from the reference's replies."""
    frame = records_frame(run_dir)
    scored = frame[(frame["path"] == "reference") & frame["metric"].isin(["answer_correct", "rules_followed"])]
    if scored.empty:
        raise SystemExit(f"{run_dir}: no answer_correct/rules_followed records of the reference")
    per_scenario = scored.groupby(["model", "kind", "scenario"])["value"].min()
    table = per_scenario.groupby(["model", "kind"]).agg(correct="sum", scenarios="count")
    table["fraction"] = table["correct"] / table["scenarios"]
    return table


def needle_chars(manifest: dict) -> list[int]:
    """Filler lengths of the run's long-context scenarios, read from its scenario files where they exist."""
    chars = set()
    for entry in manifest.get("scenario_files", []):
        file = REPO_ROOT / entry["file"] if not Path(entry["file"]).is_absolute() else Path(entry["file"])
        if file.is_file():
            data = yaml.safe_load(file.read_text()) or {}
            chars |= {s["filler"]["chars"] for s in data.get("scenarios", []) if s.get("kind") == "long_context"}
    return sorted(chars)


def repo_relative(file: str) -> str:
    path = Path(file)
    return str(path.relative_to(REPO_ROOT)) if path.is_absolute() and path.is_relative_to(REPO_ROOT) else file


def scenario_text(manifest: dict) -> str:
    files = [repo_relative(entry["file"]) for entry in manifest.get("scenario_files", [])]
    if files and all(f.startswith(ACCURACY_SET) for f in files):
        return f"`{ACCURACY_SET}` (held-out seeds, never in training)"
    return ", ".join(f"`{f}`" for f in files) + " (held-out seeds)" if files else "its scenarios"


def run_table(table: pd.DataFrame, manifest: dict, label: str, folder: str) -> list[str]:
    chars = needle_chars(manifest)
    needle = f"needle ({', '.join(map(str, chars))} filler chars)" if chars else "needle"
    titles = KIND_TITLES | {"long_context": needle}
    rows = []
    for kind, row in table.iterrows():
        target = TARGETS.get(kind)
        met = "" if target is None else ("yes" if row["fraction"] >= target else "**no**")
        rows.append(f"| {titles.get(kind, kind)} | {int(row['correct'])}/{int(row['scenarios'])} "
                    f"({100 * row['fraction']:.0f}%) | {'' if target is None else f'>= {target:.0%}'} | {met} |")
    versions = manifest.get("versions", {})
    return [
        f"`{manifest.get('command', 'harness run')}` on {manifest.get('device', '?')}, "
        f"{str(manifest.get('started_at', '?'))[:10]}, torch {versions.get('torch', '?')}, "
        f"transformers {versions.get('transformers', '?')}: greedy, bf16 weights and cache, the model's own "
        f"replies as history, on {scenario_text(manifest)}."
        + (f" The run's model `{label}` is this folder's weights, measured from a copy." if label != folder else ""),
        "",
        "| task | correct | target (issue 3) | met |",
        "|---|---:|---:|---|",
        *rows,
        "",
    ]


def card_section(runs: list[tuple[pd.DataFrame, dict]], label: str, folder: str) -> str:
    """The card's section: one paragraph and table per run (its table is this model's rows)."""
    lines = [BEGIN, "## Accuracy measured by `harness run` (the number of record)", ""]
    for table, manifest in runs:
        lines += run_table(table, manifest, label, folder)
    return "\n".join(lines[:-1] + [END])


def write_card(card: Path, section: str) -> None:
    text = card.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    card.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN",
                        help="stored runs of the canaries (e.g. on scenarios/canary/accuracy)")
    parser.add_argument("--weights", type=Path, default=Path(__file__).parent / "weights",
                        help="folder of model folders whose names are the run's model labels")
    parser.add_argument("--label", action="append", default=[], metavar="RUN_LABEL=FOLDER",
                        help="a run label that is not its weights folder's name (repeatable)")
    args = parser.parse_args(argv)
    folders = dict(item.split("=", 1) for item in args.label)
    runs = [(accuracy_by_model(run), RunStore(run).read_manifest()) for run in args.runs]
    models = dict.fromkeys(m for table, _ in runs for m in table.index.get_level_values("model"))
    for model in models:
        folder = folders.get(model, model)
        card = args.weights / folder / "README.md"
        if not card.exists():
            print(f"{model}: no model card at {card}; skipped")
            continue
        mine = [(table.loc[model], manifest) for table, manifest in runs
                if model in table.index.get_level_values("model")]
        write_card(card, card_section(mine, model, folder))
        print(f"{model}: wrote {card}")
    for table, _ in runs:
        print(table.to_string())


if __name__ == "__main__":
    main()
