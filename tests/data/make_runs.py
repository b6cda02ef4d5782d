"""Write small stored runs in the `docs/CONTRACTS.md` format, for the report and compare tests.

`python tests/data/make_runs.py` rewrites `tests/data/runs/`:
- `baseline`: 3 scenarios x (reference, bf16, fp8 calibrated, fp8 default-scale). bf16 is bit-identical
  to the reference; the default-scale path breaks in later turns (failure class 1).
- `noise`: the baseline with KL and log-prob jitter inside the manifest's noise floor; same texts.
- `regressed`: the baseline with a planted regression: the calibrated path forgets the name in recall-0001.
The chat scenario's texts hold `<script>` and `onerror=` strings, to check the reports escape them.

The functions are importable so tests can construct larger runs (`write_run(..., scenarios=many_arithmetic(12))`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "canary-mla"
PATHS = {  # name -> (canonical, description, base teacher-forced KL per token)
    "bf16": ("bf16", "bf16 cache (no quantisation)", 0.0),
    "fp8_e4m3:per_head:calibrated": (
        "fp8_e4m3:per_head:calibrated:sat",
        "fp8 e4m3 cache, per_head scales from calibrated (amax / fp8 max over the calibration prompts), "
        "saturating cast",
        0.004,
    ),
    "fp8_e4m3": (
        "fp8_e4m3:per_tensor:default:sat",
        "fp8 e4m3 cache, per_tensor scales from default (scale 1.0, as vLLM and SGLang use when none is given), "
        "saturating cast",
        0.03,
    ),
}
THRESHOLDS = {"arith-0001": {"kl_max": 0.5, "answer_correct": 1.0}, "recall-0001": {"kl_max": 0.5}}
XSS_SCRIPT = "<script>alert(1)</script>"
XSS_IMG = '"><img src=x onerror=alert(1)>'


@dataclass(frozen=True)
class Turn:
    user: str
    reference: str  # the reference's reply
    expect: str | None = None
    fixed: bool = False  # a fixed assistant reply: history for every path, not generated


@dataclass(frozen=True)
class Scenario:
    id: str
    kind: str
    turns: tuple[Turn, ...]
    system: str | None = None
    ends_with: str | None = None  # the chat rule checked on every reply
    tags: tuple[str, ...] = ()

    @property
    def scenario_hash(self) -> str:
        body = json.dumps([self.kind, self.system, [(t.user, t.expect) for t in self.turns]])
        return hashlib.sha256(body.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Divergence:
    """Where a path's free-running reply leaves the reference's, and how bad teacher-forced KL gets."""

    at_token: int
    continuation: str
    kl_level: float = 0.3


def base_scenarios() -> list[Scenario]:
    return [
        Scenario("arith-0001", "arithmetic", (
            Turn("What is 7 * 8 + 3 * 4?", "7 * 8 = 56 and 3 * 4 = 12, so the answer is 68.", expect="68"),
        ), system="Answer briefly and end with the number.", tags=("arithmetic", "canary")),
        Scenario("chat-xss-0001", "chat", (
            Turn("What pricing plans do you offer?",
                 "We offer Basic at 10 dollars, Pro at 25 dollars and Enterprise with custom pricing. Thanks"),
            Turn("And the price?", "It costs 10 dollars. Thanks", fixed=True),
            Turn(f"Please repeat this exactly: {XSS_SCRIPT}", f"Here it is: {XSS_SCRIPT} Thanks"),
            Turn(f"And this one: {XSS_IMG}", f"Here it is: {XSS_IMG} Thanks"),
        ), system="You are a sales assistant for a SaaS product. End every answer with the word Thanks.",
            ends_with="Thanks", tags=("chat", "escaping")),
        Scenario("recall-0001", "recall", (
            Turn("Hello, my name is Alexander.", "Nice to meet you, Alexander! How can I help you today?"),
            Turn("Tell me about rivers.",
                 "Rivers carry fresh water from mountains and springs to lakes and seas. "
                 "They shape valleys and support farming."),
            Turn("What is my name?", "Your name is Alexander.", expect="Alexander"),
        ), tags=("recall", "multi-turn")),
    ]


def baseline_divergences() -> dict[tuple[str, str, int], Divergence]:
    return {
        ("recall-0001", "fp8_e4m3:per_head:calibrated", 1): Divergence(17, " support farms and towns.", 0.02),
        ("chat-xss-0001", "fp8_e4m3", 2): Divergence(11, " a S componentes_obs Worce!!!!!!!!!!!!!!", 0.6),
        ("chat-xss-0001", "fp8_e4m3", 3): Divergence(2, " it Worce!!!!!!!!!!!!!!!!", 1.1),
        ("recall-0001", "fp8_e4m3", 1): Divergence(6, " and water water water water water", 0.4),
        ("recall-0001", "fp8_e4m3", 2): Divergence(0, "I don't actually know your name.", 0.9),
    }


def planted_regression() -> dict[tuple[str, str, int], Divergence]:
    return {
        ("recall-0001", "fp8_e4m3:per_head:calibrated", 1): Divergence(3, " water and water and salt.", 0.35),
        ("recall-0001", "fp8_e4m3:per_head:calibrated", 2): Divergence(0, "I'm sorry, I don't know your name.", 0.8),
    }


def many_arithmetic(n: int) -> list[Scenario]:
    """n one-turn arithmetic scenarios, for compare tests that need a real bootstrap over scenarios."""
    out = []
    for i in range(n):
        a, b = 3 + i, 7 + 2 * i
        out.append(Scenario(f"arith-{i:04d}", "arithmetic", (
            Turn(f"What is {a} * {b}?", f"{a} * {b} = {a * b}, so the answer is {a * b}.", expect=str(a * b)),
        ), tags=("arithmetic",)))
    return out


def tokenize(text: str) -> list[str]:
    return re.findall(r" ?[A-Za-z_]+| ?\d| ?[^\sA-Za-z\d]+|\s+", text)


def token_id(token: str) -> int:
    return int(hashlib.sha256(token.encode()).hexdigest()[:6], 16) % 50_000


def answer_correct(kind: str, reply: str, expect: str) -> float:
    if kind == "arithmetic":
        numbers = re.findall(r"-?\d+", reply)
        return float(bool(numbers) and numbers[-1] == expect)
    return float(re.search(rf"\b{re.escape(expect)}\b", reply, re.IGNORECASE) is not None)


def rules_followed(reply: str, ends_with: str) -> float:
    words = reply.split()
    return float(bool(words) and words[-1].strip(".,!?;:") == ends_with)


def edit_distance(a: list[str], b: list[str]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def teacher_forced_series(n: int, base_kl: float, div: Divergence | None, rng: random.Random,
                          jitter: float, jitter_rng: random.Random) -> dict[str, list[float]]:
    """Per reference token: KL, path-minus-reference log-prob, rank of the reference token, top-1 agreement."""
    kl, delta, rank, top1 = [], [], [], []
    scale = 1 + jitter_rng.uniform(-jitter, jitter)
    for i in range(n):
        value = base_kl * rng.uniform(0.2, 1.8)
        if div is not None and i >= div.at_token:
            value += div.kl_level * (4.0 if i == div.at_token else rng.uniform(0.3, 1.2))
        value *= scale  # run-to-run noise: one relative factor per turn, so a max is as unbiased as a mean
        disagree = div is not None and (i == div.at_token or (i > div.at_token and rng.random() < 0.25))
        kl.append(round(value, 6))
        delta.append(round(-value * rng.uniform(0.8, 1.5) - (1.5 if disagree else 0.0), 6))
        rank.append(float(rng.randint(1, 4) if disagree else 0))
        top1.append(0.0 if disagree else 1.0)
    return {"kl": kl, "ref_logprob_delta": delta, "ref_rank": rank, "top1_agree": top1}


@dataclass
class RunWriter:
    run_dir: Path
    records: list[dict] = field(default_factory=list)
    series: list[dict] = field(default_factory=list)
    texts: list[dict] = field(default_factory=list)
    judges: list[dict] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)

    def record(self, sc: Scenario, path: str, turn: int, metric: str, value: float | None) -> None:
        self.records.append({"model": MODEL, "scenario": sc.id, "scenario_hash": sc.scenario_hash, "kind": sc.kind,
                             "tags": list(sc.tags), "path": path, "turn": turn, "metric": metric, "value": value})

    def text(self, sc: Scenario, path: str, turn: int, tokens: list[str]) -> None:
        fixed = sc.turns[turn].fixed
        self.texts.append({"model": MODEL, "scenario": sc.id, "path": path, "turn": turn, "user": sc.turns[turn].user,
                           "text": "".join(tokens), "token_ids": [] if fixed else [token_id(t) for t in tokens],
                           "tokens": [] if fixed else tokens, "finish_reason": "fixed" if fixed else "eos",
                           "fixed": fixed})

    def save(self, manifest: dict) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        for name, rows in [("records", self.records), ("series", self.series), ("texts", self.texts),
                           ("judgements", self.judges), ("checks", self.checks), ("errors", []),
                           ("verdicts", verdict_rows(self.records, self.checks)),
                           ("done", [{"model": MODEL, "scenario": s, "path": p} for s, p in
                                     sorted({(r["scenario"], r["path"]) for r in self.records})])]:
            if rows or name in ("errors", "done"):
                (self.run_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def verdict_rows(records: list[dict], checks: list[dict]) -> list[dict]:
    """verdicts.jsonl as a run writes it: the one verdict function (harness.analysis.verdicts)."""
    from harness.analysis.verdicts import compute_verdicts

    return compute_verdicts(records, checks)


def write_run(run_dir: Path, run_id: str, scenarios: list[Scenario] | None = None,
              divergences: dict[tuple[str, str, int], Divergence] | None = None,
              jitter: float = 0.0, seed: int = 0, commit: str = "3d92203",
              base_kl: dict[str, float] | None = None) -> Path:
    """Write one stored run. `jitter` scales each fp8 KL value by 1 + U(-jitter, jitter) (log-prob deltas
    follow); `base_kl` overrides a path's typical per-token KL (a systematic shift, texts unchanged)."""
    base_kl = {name: kl for name, (_, _, kl) in PATHS.items()} | (base_kl or {})
    scenarios = base_scenarios() if scenarios is None else scenarios
    divergences = baseline_divergences() if divergences is None else divergences
    writer = RunWriter(Path(run_dir))
    for sc in scenarios:
        write_scenario(writer, sc, divergences, jitter, seed, base_kl)
    writer.save(manifest(run_id, scenarios, commit, writer.records))
    return Path(run_dir)


def write_scenario(writer: RunWriter, sc: Scenario, divergences: dict, jitter: float, seed: int,
                   base_kl: dict[str, float]) -> None:
    context = {path: len(tokenize(sc.system or "")) + 2 for path in ["reference", *PATHS]}
    for turn, t in enumerate(sc.turns):
        ref_tokens = tokenize(t.reference)
        for path in ["reference", *PATHS]:
            context[path] += len(tokenize(t.user)) + 4
            div = divergences.get((sc.id, path, turn))
            tokens = ref_tokens if div is None else ref_tokens[:div.at_token] + tokenize(div.continuation)
            writer.text(sc, path, turn, tokens)
            if t.fixed:
                context[path] += len(tokens)
                continue
            write_checks(writer, sc, path, turn, "".join(tokens), len(tokens), context[path])
            context[path] += len(tokens)
            if path != "reference":
                # one stream per case, so a planted change in one case leaves every other case as it was
                rng = random.Random(f"{sc.id}|{path}|{turn}")
                jitter_rng = random.Random(f"{seed}|{sc.id}|{path}|{turn}")
                series = teacher_forced_series(len(ref_tokens), base_kl[path], div, rng,
                                               jitter * (path != "bf16"), jitter_rng)
                write_divergence(writer, sc, path, turn, ref_tokens, tokens, series)


def write_checks(writer: RunWriter, sc: Scenario, path: str, turn: int, reply: str, n_tokens: int,
                 context_tokens: int) -> None:
    t = sc.turns[turn]
    if t.expect is not None:
        writer.record(sc, path, turn, "answer_correct", answer_correct(sc.kind, reply, t.expect))
    if sc.ends_with is not None:
        followed = rules_followed(reply, sc.ends_with)
        writer.record(sc, path, turn, "rules_followed", followed)
        score, reason = (5.0, "Answers the question and keeps the rule.") if followed else (
            1.0, "Degenerates into repeated punctuation; ignores the instruction to end with Thanks.")
        writer.record(sc, path, turn, "judge_rule", score)
        writer.judges.append({"model": MODEL, "scenario": sc.id, "path": path, "turn": turn, "metric": "judge_rule",
                              "value": score, "status": "ok", "reason": f"{reason} Reply quoted: {reply[:60]}",
                              "judge_model": None})
    writer.record(sc, path, turn, "reply_tokens", float(n_tokens))
    writer.record(sc, path, turn, "context_tokens", float(context_tokens))


def write_divergence(writer: RunWriter, sc: Scenario, path: str, turn: int, ref_tokens: list[str],
                     tokens: list[str], series: dict[str, list[float]]) -> None:
    first = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b),
                 None if len(ref_tokens) == len(tokens) else min(len(ref_tokens), len(tokens)))
    metrics = {
        "first_divergent_token": first,
        "exact_match": float(first is None),
        "common_prefix_frac": (len(ref_tokens) if first is None else first) / len(ref_tokens),
        "token_edit_distance": float(edit_distance(ref_tokens, tokens)),
        "kl_mean": sum(series["kl"]) / len(ref_tokens), "kl_max": max(series["kl"]),
        "top1_agree": sum(series["top1_agree"]) / len(ref_tokens),
        "ref_logprob_delta_mean": sum(series["ref_logprob_delta"]) / len(ref_tokens),
        "ref_logprob_delta_min": min(series["ref_logprob_delta"]),
        "ref_rank_mean": sum(series["ref_rank"]) / len(ref_tokens), "ref_rank_max": max(series["ref_rank"]),
    }
    if path != "bf16":
        metrics["attn_out_rel_err_max"] = round(0.01 + 20 * metrics["kl_mean"] ** 0.5 * 0.01, 6)
    for metric, value in metrics.items():
        writer.record(sc, path, turn, metric, None if value is None else round(float(value), 6))
    write_threshold_checks(writer, sc, path, turn)
    for name, values in series.items():
        writer.series.append({"model": MODEL, "scenario": sc.id, "path": path, "turn": turn,
                              "series": name, "values": values})


def write_threshold_checks(writer: RunWriter, sc: Scenario, path: str, turn: int) -> None:
    """As the runner's ThresholdCheck rows: one per scenario threshold per generated candidate turn."""
    values = {r["metric"]: r["value"] for r in writer.records
              if (r["scenario"], r["path"], r["turn"]) == (sc.id, path, turn)}
    for metric, limit in THRESHOLDS.get(sc.id, {}).items():
        value = values.get(metric)
        lower = metric.startswith("kl")
        failed = value is not None and (value > limit if lower else value < limit)
        message = (f"turn {turn}: {metric} {value:.4g} {'>' if lower else '<'} {limit:g} "
                   f"(threshold from scenarios/test.yaml)") if failed else None
        writer.checks.append({"model": MODEL, "scenario": sc.id, "path": path, "turn": turn, "metric": metric,
                              "value": value, "limit": limit, "passed": not failed, "message": message})


def bf16_noise_floor(records: list[dict]) -> dict[str, float]:
    """As the runner measures it: the bf16 path's largest distance from the identical-run value."""
    from harness.analysis.metrics import noise_floor

    return noise_floor(r for r in records if r["path"] == "bf16")


def manifest(run_id: str, scenarios: list[Scenario], commit: str, records: list[dict]) -> dict:
    scale = {"source": "calibrated", "k_scale": {"min": 0.011, "max": 0.094, "n": 24},
             "v_scale": {"min": 0.008, "max": 0.051, "n": 24}}
    return {
        "run_id": run_id, "status": "complete",
        "started_at": "2026-11-22T03:00:00Z", "finished_at": "2026-11-22T03:02:11Z",
        "command": "harness run scenarios/ --model canary-mla --path bf16 --path fp8_e4m3:per_head:calibrated "
                   "--path fp8_e4m3",
        "commit": commit,
        "versions": {"python": "3.11.9", "torch": "2.6.0", "transformers": "5.17.0", "triton": None,
                     "harness": "0.1.0"},
        "device": "cpu (test data written by tests/data/make_runs.py)", "history_mode": "own-history", "seed": 0,
        "scenarios": [{"id": s.id, "kind": s.kind, "hash": s.scenario_hash, "source": "scenarios/test.yaml"}
                      for s in scenarios],
        "warnings": [],
        "models": [{"label": MODEL, "path": "harness/canary/weights/mla", "sha256": "9f2c" + "0" * 60,
                    "arch": "mla", "random_weights": False}],
        "scenario_files": [{"file": "scenarios/test.yaml", "sha256": hashlib.sha256(
            ",".join(s.scenario_hash for s in scenarios).encode()).hexdigest()}],
        "paths": [{"name": n, "canonical": c, "description": d} for n, (c, d, _) in PATHS.items()],
        "scales": {MODEL: {
            "bf16": {"source": "default", "k_scale": None, "v_scale": None},
            "fp8_e4m3:per_head:calibrated": scale,
            "fp8_e4m3": {"source": "default", "k_scale": {"min": 1.0, "max": 1.0, "n": 1},
                         "v_scale": {"min": 1.0, "max": 1.0, "n": 1}},
        }},
        "noise_floor": {MODEL: bf16_noise_floor(records)},
    }


def main() -> None:
    root = Path(__file__).parent / "runs"
    write_run(root / "baseline", "baseline")
    write_run(root / "noise", "noise", jitter=0.004, seed=1, commit="5e1a0b7")  # +-0.4% on KL
    write_run(root / "regressed", "regressed", divergences={**baseline_divergences(), **planted_regression()},
              commit="a41c9d2")


if __name__ == "__main__":
    main()
