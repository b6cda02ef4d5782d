"""Tensor parallel against one device: the same model, prompts and KV paths replayed at TP=1 (this process) and
at TP=N (a process per rank, `harness.replay.tensor_parallel`), printing the noise floor between them.

Generation: greedy tokens of each side and how many agree before the first difference. Teacher-forced: both sides
score the TP=1 continuation, so the log-probs compare position by position (KL(TP1 || TPN) per token, mean and
max, and the max |log-prob| difference of the continuation tokens). Splitting a reduction (o_proj, down_proj, the
LM head's gather) over ranks changes bf16 rounding, so these are measured, not expected to be zero.

    python benchmarks/tp_compare.py --device cuda:0,1 harness/canary/weights/{gqa,mla,hybrid}
    python benchmarks/tp_compare.py --device cpu,cpu harness/canary/weights/gqa      # gloo on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SPECS = (None, "bf16", "fp8_e4m3", "fp8_e4m3:calibrated", "fp8_e4m3:calibrated:per_head")
PROMPTS = ("What is 17 + 25? Answer with the number.", "Hello, my name is Alexander. What is my name?")


def replay(loaded, specs, prompts, max_new: int, continuations: dict | None = None) -> dict:
    """{(spec, prompt index): {tokens, logprobs (of `continuations` when given, else of its own tokens), scales}}"""
    from harness.kv_paths.spec import parse_path
    from harness.types import Message

    out = {}
    for spec in specs:
        backend = loaded.backend(parse_path(spec) if spec else None)
        for i, prompt in enumerate(prompts):
            messages = [Message("user", prompt)]
            tokens = backend.generate_sync(messages, max_new).token_ids
            scored = (continuations or {}).get((spec, i), tokens)
            logprobs = backend.score_sync(messages, scored).logprobs.float().cpu()
            out[(spec, i)] = {"tokens": tokens, "logprobs": logprobs, "scales": backend.describe().get("scales")}
    return out


def _rank(rank: int, devices: list[str], port: int, models: list[str], specs, prompts, max_new, continuations,
          queue) -> None:
    from harness.replay import tensor_parallel

    if devices[0] == "cpu":
        torch.set_num_threads(1)
    tensor_parallel.init_rank(rank, devices, port)
    try:
        from harness.replay.inprocess import InProcessModel

        results = {}
        for model in models:
            loaded = InProcessModel.load(model, device=",".join(devices), shard="tensor")
            results[model] = replay(loaded, specs, prompts, max_new, continuations[model])
        if rank == 0:
            queue.put(results)
    except BaseException as error:  # noqa: BLE001 - said to the parent, which raises it
        queue.put({"error": f"rank {rank}: {type(error).__name__}: {error}"})
        raise
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def run_ranks(devices: list[str], models: list[str], specs, prompts, max_new: int, continuations: dict) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from harness.replay.tensor_parallel import free_port

    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, devices, port, models, specs, prompts, max_new, continuations, queue))
             for r in range(len(devices))]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def noise(one: dict, many: dict) -> dict:
    """Per spec: token agreement of the greedy generations and the teacher-forced log-prob distance."""
    rows = {}
    for spec in dict.fromkeys(k[0] for k in one):
        keys = [k for k in one if k[0] == spec]
        agree, total, kls, diffs = 0, 0, [], []
        identical = True
        for key in keys:
            a, b = one[key]["tokens"], many[key]["tokens"]
            prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            agree += prefix
            total += len(a)
            identical &= a == b
            la, lb = one[key]["logprobs"], many[key]["logprobs"]
            kl = (la.exp() * (la - lb)).sum(-1)  # KL(TP1 || TPN) at each continuation position
            kls.append(kl)
            picked = torch.tensor(one[key]["tokens"])[: la.shape[0]]
            diffs.append((la.gather(-1, picked[:, None]) - lb.gather(-1, picked[:, None])).abs())
        kl = torch.cat(kls)
        rows[spec or "reference"] = {"tokens_identical": identical, "tokens_agreeing_before_first_difference":
                                     f"{agree}/{total}", "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                                     "max_abs_logprob_diff": float(torch.cat(diffs).max()),
                                     "scales_equal": one[keys[0]]["scales"] == many[keys[0]]["scales"]}
    return rows


def compare(models: list[str], devices: list[str], specs=SPECS, prompts=PROMPTS, max_new: int = 16) -> dict:
    """{model: {spec: noise row}}: TP=1 on devices[0] in this process against TP=len(devices)."""
    from harness.replay.inprocess import InProcessModel

    one = {}
    if devices[0].startswith("cuda"):
        torch.cuda.set_device(devices[0])
    for model in models:
        loaded = InProcessModel.load(model, device=devices[0])
        one[model] = replay(loaded, specs, prompts, max_new)
        del loaded
    continuations = {m: {k: v["tokens"] for k, v in rows.items()} for m, rows in one.items()}
    many = run_ranks(devices, models, specs, prompts, max_new, continuations)
    return {model: noise(one[model], many[model]) for model in models}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--device", default="cuda:0,1", help="the ranks' devices: cuda:0,1 or cpu,cpu")
    parser.add_argument("--max-new", type=int, default=16)
    args = parser.parse_args(argv)
    from harness.replay.tensor_parallel import split_world

    devices = split_world(args.device)
    result = compare(args.models, devices, max_new=args.max_new)
    for model, rows in result.items():
        print(f"== {model}: TP={len(devices)} ({','.join(devices)}) vs TP=1 ({devices[0]})")
        for spec, row in rows.items():
            print(f"  {spec:32s} {json.dumps(row)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
