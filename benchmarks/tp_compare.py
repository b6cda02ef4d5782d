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
import time
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
            out[(spec, i)] = {"tokens": tokens, "logprobs": logprobs, "scales": _tensors(backend.stated_scales),
                              "rank_scales": _tensors(backend.scales)}
    return out


def _tensors(scales) -> dict:
    """{("k"|"v", layer): fp32 scale tensor} of a LayerScales (empty for none)."""
    if scales is None:
        return {}
    return {**{("k", i): s.float().cpu() for i, s in scales.k.items()},
            **{("v", i): s.float().cpu() for i, s in scales.v.items()}}


def scale_difference(one: dict, many: dict) -> float | None:
    """Largest relative difference between two runs' scales; None when their layers or shapes differ."""
    if one.keys() != many.keys() or any(one[k].shape != many[k].shape for k in one):
        return None
    return max((float(((one[k] - many[k]).abs() / one[k].abs()).max()) for k in one), default=0.0)


BENCH_SPECS = (None, "fp8_e4m3")


def decode_rates(loaded, specs=BENCH_SPECS, length: int = 256, new: int = 128) -> dict:
    """{spec: tokens/s} of one greedy sequence (`length` random prompt ids, `new` tokens, prefill included in
    the wall), after a warm-up generation that compiles the kernels."""
    from harness.kv_paths.spec import parse_path

    vocab = loaded.model.config.vocab_size
    prompt = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    rates = {}
    for spec in specs:
        backend = loaded.backend(parse_path(spec) if spec else None)
        backend.greedy_ids(prompt, 8)
        _sync(loaded.device)
        start = time.perf_counter()
        ids, _, _ = backend.greedy_ids(prompt, new)
        _sync(loaded.device)
        rates[spec or "reference"] = len(ids) / (time.perf_counter() - start)
    return rates


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _as_bytes(value) -> bytes:
    """Results as bytes: tensors put on a queue as torch shares them (file descriptors) die with their rank."""
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes):
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


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
            if continuations == "bench":
                results[model] = decode_rates(loaded)
            else:
                results[model] = replay(loaded, specs, prompts, max_new, continuations[model])
        if rank == 0:
            queue.put(_as_bytes(results))
    except BaseException as error:  # noqa: BLE001 - said to the parent, which raises it
        queue.put(_as_bytes({"error": f"rank {rank}: {type(error).__name__}: {error}"}))
        raise
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _spawn_ranks(devices: list[str], target, args: tuple, timeout: float) -> dict:
    """A spawned process per rank running target(rank, devices, port, *args, queue); rank 0's result (or the first
    rank error, raised here)."""
    import torch.multiprocessing as mp

    from harness.replay.tensor_parallel import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, devices, port, *args, queue)) for r in range(len(devices))]
    for p in procs:
        p.start()
    try:
        result = _from_bytes(queue.get(timeout=timeout))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def run_ranks(devices: list[str], models: list[str], specs, prompts, max_new: int, continuations: dict) -> dict:
    return _spawn_ranks(devices, _rank, (models, specs, prompts, max_new, continuations), 600)


def _random_rank(rank: int, devices: list[str], port: int, directory: str, seed: int, queue) -> None:
    """Rank `rank` makes the random-weights model of `directory` through `tensor_parallel.load` and checks that
    its slices, gathered, are the whole model made from the same seed on one device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.replay import tensor_parallel
    from harness.replay.inprocess import ATTENTION_NAME  # registers the harness attention function

    if devices[0] == "cpu":
        torch.set_num_threads(1)
    tensor_parallel.init_rank(rank, devices, port)
    try:
        model = tensor_parallel.load(Path(directory), torch.bfloat16, ATTENTION_NAME, True, devices[rank], seed)
        torch.manual_seed(seed)
        with torch.device(devices[rank]):
            whole = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.bfloat16,
                                                     attn_implementation=ATTENTION_NAME)
        whole_params = dict(whole.named_parameters())
        sharded, mismatched = 0, []
        for name, param in model.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            sharded += local.shape != param.shape
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            if not torch.equal(full.cpu(), whole_params[name].detach().cpu()):
                mismatched.append(name)
        if rank == 0:
            queue.put(_as_bytes({"sharded": sharded, "mismatched": mismatched}))
    except BaseException as error:  # noqa: BLE001 - said to the parent, which raises it
        queue.put(_as_bytes({"error": f"rank {rank}: {type(error).__name__}: {error}"}))
        raise
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def check_random_weights(directory: str, devices: list[str], seed: int = 0) -> dict:
    """{sharded: parameters cut over the ranks, mismatched: names whose gathered slices differ from the whole
    seeded model} for a random-weights directory without weight files."""
    return _spawn_ranks(devices, _random_rank, (directory, seed), 300)


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
                                     "scales_max_rel_diff": scale_difference(one[keys[0]]["scales"],
                                                                             many[keys[0]]["scales"])}
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


def bench_8b(devices: list[str], out: Path) -> dict:
    """Decode tok/s of one sequence of an 8B-shaped random Llama (scale_bench's) at TP=1 on devices[0] and at
    TP=len(devices); the TP ranks make the same seeded weights whole on their GPU, then cut them."""
    from benchmarks.scale_bench import build, llama_8b, write_random_model_dir

    torch.cuda.set_device(devices[0])
    one = decode_rates(build(llama_8b()))
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    directory = write_random_model_dir(out, llama_8b(), ROOT / "harness/canary/weights/gqa")
    many = run_ranks(devices, [str(directory)], (), (), 0, "bench")[str(directory)]
    return {spec: {"tp1_tok_s": one[spec], f"tp{len(devices)}_tok_s": many[spec], "ratio": many[spec] / one[spec]}
            for spec in one}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--device", default="cuda:0,1", help="the ranks' devices: cuda:0,1 or cpu,cpu")
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--bench-8b", type=Path, default=None, metavar="DIR",
                        help="also time one-sequence decode of an 8B-shaped random Llama at TP=1 and TP=N (CUDA), its "
                             "random-weights model directory written to DIR")
    args = parser.parse_args(argv)
    from harness.replay.tensor_parallel import split_world

    devices = split_world(args.device)
    result = compare(args.models, devices, max_new=args.max_new)
    for model, rows in result.items():
        print(f"== {model}: TP={len(devices)} ({','.join(devices)}) vs TP=1 ({devices[0]})")
        for spec, row in rows.items():
            print(f"  {spec:32s} {json.dumps(row)}", flush=True)
    if args.bench_8b is not None:
        for spec, row in bench_8b(devices, args.bench_8b).items():
            print(f"== 8B-shaped one-sequence decode, {spec}: {json.dumps(row)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
