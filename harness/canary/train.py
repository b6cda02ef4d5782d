"""Train one canary model on the synthetic corpus and save it with its tokenizer and model card.

    python -m harness.canary.train --arch gqa|mla|hybrid --steps N --seed S --out DIR [--device cuda]

Each step trains on two batches: short dialogues (arithmetic, recall, rule chats) and long-context
needle dialogues; the loss is cross-entropy on assistant tokens only (reply + <|end|>). AdamW with
linear warm-up then a cosine decay; bf16 autocast on CUDA, fp32 on CPU. Training attention is causal
SDPA with no mask tensor (`causal_attention`), so CUDA runs its flash kernel, compiled or not. At the
end the model answers held-out dialogues greedily, turn by turn, with its own replies as history (as the
harness replays them), and the accuracy per task goes to the log and to the model card.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import signal
import string
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.canary import corpus, delta_rule
from harness.canary.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, save_tokenizer
from harness.forward_context import forward_context

PAD_ID = SPECIAL_TOKENS.index("<|pad|>")
EOS_ID = SPECIAL_TOKENS.index("<|end|>")
ARCHS = ("gqa", "mla", "hybrid")
SHORT_KIND_WEIGHTS = {"arithmetic": 0.4, "recall": 0.2, "chat": 0.2, "echo": 0.2}  # echo: a copy drill
HELDOUT_SEED = 1  # held-out dialogues come from corpus.split_rng(HELDOUT_SEED, "heldout")


def model_config(arch: str):
    """A few-million-parameter config of the arch's transformers class, over the canary vocabulary."""
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=256, num_attention_heads=8, max_position_embeddings=4096,
        rms_norm_eps=1e-6, pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=None,
        tie_word_embeddings=False, initializer_range=0.02,
    )
    if arch == "gqa":
        from transformers import LlamaConfig

        return LlamaConfig(num_hidden_layers=6, num_key_value_heads=2, head_dim=32, intermediate_size=512, **common)
    if arch == "mla":
        from transformers import DeepseekV3Config

        # All layers dense (first_k_dense_replace = num layers): no experts are built. The cache holds
        # the kv_lora_rank latent plus the qk_rope_head_dim RoPE key per token.
        return DeepseekV3Config(
            num_hidden_layers=6, num_key_value_heads=8, intermediate_size=512, q_lora_rank=128, kv_lora_rank=64,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=6,
            n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=64, num_experts_per_tok=1,
            n_group=1, topk_group=1, num_nextn_predict_layers=0, **common,
        )
    if arch == "hybrid":
        from transformers import Qwen3NextConfig

        # 3 Gated-DeltaNet (linear attention) layers per full-attention layer; dense MLP (num_experts=0).
        return Qwen3NextConfig(
            num_hidden_layers=8, layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
            + ["full_attention"], num_key_value_heads=2, head_dim=32, intermediate_size=384,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, num_experts=0, mlp_only_layers=list(range(8)), **common,
        )
    raise ValueError(f"--arch must be one of {ARCHS}, got {arch!r}")


# --- batches -------------------------------------------------------------------------------------


SHORT_BUCKETS = (128, 448, 1088)  # row widths below the long one: arithmetic/echo, chats/recall, short needles


def long_width(needle_chars: int) -> int:
    return -(-(needle_chars + 112) // 64) * 64  # filler + needle, question, reply and markers (<= 91 more)


def bucket_widths(needle_chars: int, short: tuple[int, ...] = SHORT_BUCKETS) -> tuple[int, ...]:
    """Fixed row widths, one compiled graph each; every dialogue goes to the narrowest that holds it."""
    return tuple(sorted({*short, long_width(needle_chars)}))


def collate(encoded: list[tuple[list[int], list[bool]]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids right-padded to `width` and next-token labels (-100 where no assistant token is predicted)."""
    input_ids = torch.full((len(encoded), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    for row, (ids, mask) in enumerate(encoded):
        ids_t = torch.tensor(ids)
        input_ids[row, : len(ids)] = ids_t
        target = torch.where(torch.tensor(mask), ids_t, torch.tensor(-100))
        labels[row, : len(ids) - 1] = target[1:]
    return input_ids, labels


class StepBatches(torch.utils.data.IterableDataset):
    """Endless training steps, each {width: (input_ids, labels, needle)} with a fixed row count per width;
    `needle` marks the rows that are long-context dialogues (weighted as their own half of the loss).

    Dialogues are drawn as before (short kinds by `mix`, long needles at long/(short+long)
    of draws) and sorted into width buckets, so a 60-token sum no longer pads to the longest chat: about
    half the padded tokens of one width per batch. Rows per bucket are the expected counts for a step of
    `short` + `long` dialogues (estimated from a fixed sample); a bucket that fills first keeps at most
    one step of spill-over for the next. Each DataLoader worker has its own seeded stream."""

    def __init__(self, seed: int, short: int, long: int, needle_chars: int, widths: tuple[int, ...],
                 mix: dict[str, float] = SHORT_KIND_WEIGHTS, needle_min_chars: int = corpus.MIN_NEEDLE_CHARS):
        self.seed, self.needle_chars, self.needle_min_chars, self.widths = seed, needle_chars, needle_min_chars, widths
        self.kinds, self.kind_weights = zip(*mix.items())
        self.long_share = long / (short + long)
        probe = random.Random(f"canary-buckets:{seed}")
        counts = dict.fromkeys(widths, 0)
        draws = 4000
        for _ in range(draws):
            width = self._width(len(self._draw(probe)[0]))
            if width:
                counts[width] += 1
        self.rows = {w: max(1, round(c / draws * (short + long))) for w, c in counts.items()}

    def _draw(self, rng: random.Random) -> tuple[list[int], list[bool], bool]:
        if rng.random() < self.long_share:
            dialogue = corpus.sample(rng, "long_context", "train", self.needle_chars, self.needle_min_chars)
        else:
            dialogue = corpus.sample(rng, rng.choices(self.kinds, self.kind_weights)[0], "train")
        return (*corpus.encode_dialogue(dialogue), dialogue.kind == "long_context")

    def _width(self, length: int) -> int | None:
        """The narrowest width that holds `length` tokens; None (dropped) past the widest."""
        return next((w for w in self.widths if length <= w), None)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = corpus.split_rng(self.seed, "train") if info is None else random.Random(
            f"canary-corpus:train:{self.seed}:worker{info.id}")
        queues: dict[int, list] = {w: [] for w in self.widths}
        while True:
            while any(len(queues[w]) < self.rows[w] for w in self.widths):
                drawn = self._draw(rng)
                width = self._width(len(drawn[0]))
                if width and len(queues[width]) < 2 * self.rows[width]:
                    queues[width].append(drawn)
            step = {}
            for w in self.widths:
                rows, queues[w] = queues[w][: self.rows[w]], queues[w][self.rows[w]:]
                step[w] = (*collate([(ids, mask) for ids, mask, _ in rows], w),
                           torch.tensor([needle for _, _, needle in rows]))
            yield step


def training_batches(args: argparse.Namespace, widths: tuple[int, ...]):
    """Endless steps from StepBatches; on CUDA built by background worker processes, pinned, so the
    Python data work (~30 ms a step) overlaps the GPU's."""
    data = StepBatches(args.seed, args.short_batch, args.long_batch, args.needle_chars, widths, args.mix,
                       args.needle_min_chars)
    workers = args.data_workers if args.device.startswith("cuda") else 0
    loader = torch.utils.data.DataLoader(
        data, batch_size=None, num_workers=workers, pin_memory=workers > 0, prefetch_factor=8 if workers else None,
        persistent_workers=workers > 0, multiprocessing_context="spawn" if workers else None)
    return data.rows, iter(loader)


TIMING_STEPS = (10, 40)  # steps timed for --time-budget; both inside the warm-up, whose lr ignores --steps


def steps_for_budget(args: argparse.Namespace, seconds_per_step: float, elapsed: float) -> int:
    """The step count that fits --time-budget at the measured speed (a multiple of 100, at most --steps);
    `elapsed` (compilation included) is already spent."""
    remaining_steps = (args.time_budget - elapsed) / seconds_per_step
    steps = max(100, int(TIMING_STEPS[1] + remaining_steps) // 100 * 100)
    log(args, f"{seconds_per_step * 1000:.0f} ms/step: {min(steps, args.steps)} steps fit {args.time_budget} s")
    return min(steps, args.steps)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10% of peak


# --- training attention ----------------------------------------------------------------------------

TRAIN_ATTENTION = "canary_causal"  # registered with transformers' attention and mask interfaces


def causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA over whole rows, for training only: rows are right-padded, so padding only ever follows
    the tokens that count and no mask tensor is needed. transformers' own sdpa path builds a [rows, 1, L, L]
    mask whenever it cannot prove the mask redundant, which under torch.compile it never can (5.17: whenever
    dynamo compiles; 5.23: before torch 2.14); with a mask CUDA cannot use the flash kernel (at 16k tokens
    the mask alone is 256 MB a row). Measured with it (and with 16 needle rows instead of 8): a 16k-needle
    step went from 790 to 347 ms on an H100 (harness/canary/weights/stress/gqa-long16k/README.md).
    K/V heads are repeated for GQA (not `enable_gqa`, which some backends refuse); q and k take v's dtype
    (RoPE in fp32 promotes them under autocast), so the flash kernel's bf16 inputs hold on CUDA."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query.to(value.dtype), key.to(value.dtype), value, is_causal=True,
                                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None


def register_training_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TRAIN_ATTENTION, causal_attention)
    AttentionMaskInterface.register(TRAIN_ATTENTION, _no_mask)


class attention_implementation:
    """Switch a model's attention for a block: `causal_attention` for training steps, transformers' sdpa
    (with padding masks) for the left-padded batches of `generate`."""

    def __init__(self, model, name: str):
        self.config, self.name = model.config, name

    def __enter__(self):
        self.before = self.config._attn_implementation
        self.config._attn_implementation = self.name

    def __exit__(self, *exc):
        self.config._attn_implementation = self.before


# --- greedy replay and checks (CONTRACTS.md "Answer checks") -------------------------------------


def answer_correct(kind: str, reply: str, answer: str) -> bool:
    if kind == "arithmetic":
        numbers = re.findall(r"-?\d+", reply)
        return bool(numbers) and int(numbers[-1]) == int(answer)
    return re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", reply, re.IGNORECASE) is not None


def rules_kept(rules: dict, reply: str) -> bool:
    words = reply.split()
    if "ends_with" in rules and (not words or words[-1].rstrip(string.punctuation) != rules["ends_with"]):
        return False
    sentences = [s for s in re.findall(r"[^.!?]*[.!?]+", reply) if s.strip(" .!?")]
    return "max_sentences" not in rules or 1 <= len(sentences) <= rules["max_sentences"]


@torch.no_grad()
def generate(model, prompts: list[list[dict]], max_new_tokens: int, device: str) -> list[str]:
    """Greedy replies to chats ending in a user message, batched with left padding."""
    encoded = [corpus.encode_text_with_specials(corpus.render_chat(m, add_generation_prompt=True)) for m in prompts]
    width = max(map(len, encoded))
    input_ids = torch.full((len(encoded), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    with forward_context():  # every model call enters one (harness/forward_context.py); none of ours applies here
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        )
    return [corpus.decode_reply(row[width:].tolist()) for row in out]


def replay(model, dialogues: list[corpus.Dialogue], device: str, batch_size: int = 128) -> list[dict]:
    """Play every dialogue turn by turn with the model's own replies as history; one result per dialogue."""
    results = []
    for start in range(0, len(dialogues), batch_size):
        chunk = dialogues[start : start + batch_size]
        histories = [[{"role": "system", "content": d.system}] if d.system else [] for d in chunk]
        replies: list[list[str]] = [[] for _ in chunk]
        for turn in range(max(len(d.turns) for d in chunk)):
            live = [i for i, d in enumerate(chunk) if turn < len(d.turns)]
            for i in live:
                histories[i].append({"role": "user", "content": chunk[i].turns[turn].user})
            kind = chunk[live[0]].kind
            texts = generate(model, [histories[i] for i in live], corpus.MAX_NEW_TOKENS[kind], device)
            for i, text in zip(live, texts):
                histories[i].append({"role": "assistant", "content": text})
                replies[i].append(text)
        results += [score(d, r) for d, r in zip(chunk, replies)]
    return results


GENERATE_TOKENS = 262_144  # prompt tokens per generate batch; its [rows, 1, L, L] bool mask is rows x L^2 bytes


def replay_gold_history(model, dialogues: list[corpus.Dialogue], device: str, batch_size: int = 256) -> list[dict]:
    """Generate only the scored turns (every chat turn, else the last), with the gold replies as history.

    One batched generate per chunk instead of one per turn: ~6x fewer decode steps than `replay`. Where the
    model reproduces the gold replies (what it is trained to do) the two agree."""
    scored = [(d, t) for d in dialogues for t in (range(len(d.turns)) if d.kind == "chat" else [len(d.turns) - 1])]
    longest = max((len(d.turns[t].user) for d, t in scored), default=1)
    batch_size = max(1, min(batch_size, GENERATE_TOKENS // longest))  # 16k-token needles: 16 a batch
    texts: list[str] = []
    for start in range(0, len(scored), batch_size):
        chunk = scored[start : start + batch_size]
        kind = chunk[0][0].kind
        texts += generate(model, [d.messages(upto=t) for d, t in chunk], corpus.MAX_NEW_TOKENS[kind], device)
    replies: dict[int, list[str]] = {}
    for (dialogue, _), text in zip(scored, texts):
        replies.setdefault(id(dialogue), []).append(text)
    return [score(d, replies[id(d)]) for d in dialogues]


def score(dialogue: corpus.Dialogue, replies: list[str]) -> dict:
    if dialogue.kind == "chat":
        correct = all(rules_kept(dialogue.rules, r) for r in replies)
    else:
        correct = answer_correct(dialogue.kind, replies[-1], dialogue.turns[-1].expect)
    return {"kind": dialogue.kind, "correct": correct, "replies": replies,
            "expect": dialogue.turns[-1].expect if dialogue.kind != "chat" else dialogue.rules}


def heldout_dialogues(per_kind: int, needle_chars: int = corpus.MAX_NEEDLE_CHARS,
                      kinds: tuple[str, ...] = corpus.KINDS) -> dict[str, list[corpus.Dialogue]]:
    return {kind: corpus.heldout_set(kind, per_kind, HELDOUT_SEED, **(
        {"chars": needle_chars} if kind == "long_context" else {})) for kind in kinds}


def evaluate(model, per_kind: int, needle_chars: int, device: str, history: str = "own",
             kinds: tuple[str, ...] = corpus.KINDS) -> tuple[dict, list]:
    """Accuracy per task on held-out dialogues; `history` "own" replays every turn, "gold" only scored ones."""
    if per_kind == 0:
        return {}, []
    model.eval()
    accuracy, failures = {}, []
    play = replay if history == "own" else replay_gold_history
    for kind, dialogues in heldout_dialogues(per_kind, needle_chars, kinds).items():
        results = play(model, dialogues, device)
        accuracy[kind] = sum(r["correct"] for r in results) / len(results)
        failures += [r for r in results if not r["correct"]][:3]
    model.train()
    return accuracy, failures


# --- training --------------------------------------------------------------------------------------


class Interrupted(Exception):
    """SIGTERM (e.g. from `timeout`): stop, and save what there is."""


def _raise_interrupted(signum, frame):
    raise Interrupted()


def train(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    assert not args.time_budget or args.warmup >= TIMING_STEPS[1], "--time-budget times steps inside the warm-up"
    signal.signal(signal.SIGTERM, _raise_interrupted)
    if args.init:  # continue an earlier run: its weights, a fresh optimiser and schedule
        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32).to(args.device)
        earlier = json.loads((Path(args.init) / "training.json").read_text())
        assert earlier["arch"] == args.arch, f"--init {args.init} holds a {earlier['arch']} model, not {args.arch}"
    else:
        model = AutoModelForCausalLM.from_config(model_config(args.arch)).to(args.device)
        earlier = None
    if args.arch == "hybrid":
        delta_rule.install(model)  # same math as transformers' torch fallback, far fewer kernels
    params = sum(p.numel() for p in model.parameters())
    log(args, f"arch={args.arch} class={type(model).__name__} params={params} device={device_name(args.device)}")
    summary = {"arch": args.arch, "model_class": type(model).__name__, "params": params, "seed": args.seed,
               "device": device_name(args.device), "eval_per_kind": args.eval_per_kind, "accuracy": {},
               "versions": versions(), "init": earlier and {key: earlier.get(key) for key in (
                   "steps", "steps_done", "train_seconds", "device", "accuracy", "args", "init")}}
    started = time.time()
    register_training_attention()
    try:
        with attention_implementation(model, TRAIN_ATTENTION):
            summary["final_loss"] = train_steps(model, args)
        summary["train_seconds"] = round(time.time() - started, 1)
        model.to(torch.bfloat16)  # measured as shipped
        accuracy, failures = evaluate(model, args.eval_per_kind, args.needle_chars, args.device, args.eval_history)
        summary["accuracy"] = accuracy
        log(args, f"held-out accuracy {json.dumps(accuracy)} (eval {time.time() - started - summary['train_seconds']:.0f}s)")
        for failure in failures:
            log(args, f"miss: {json.dumps(failure)[:400]}")
    except Interrupted:
        if "train_seconds" in summary:  # every step ran; the held-out evaluation was cut short
            summary["interrupted"] = (f"completed; SIGTERM {time.time() - started:.0f} s in, during the held-out "
                                      "evaluation, so the table below is empty")
        else:
            summary["interrupted"] = f"SIGTERM after {time.time() - started:.0f} s; weights as they were then"
        summary.setdefault("train_seconds", round(time.time() - started, 1))
        log(args, summary["interrupted"])
    rows = getattr(args, "bucket_rows", {})
    summary.update(steps=args.steps, steps_done=getattr(args, "steps_done", None), args=vars(args),
                   widths=[int(w) for w in rows], rows=", ".join(map(str, rows.values())))
    save(model, args.out, summary)
    return summary


def step_batch(host_batch: dict, device: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, labels, row weight) per width on `device`. Short dialogues' tokens share one mean and
    long-context ones another, and the loss is their sum (as when they were separate batches), so the few
    answer tokens of the needles weigh as much as all the short replies."""
    needle_targets = sum(int((labels[needle] != -100).sum()) for _, labels, needle in host_batch.values())
    short_targets = sum(int((labels != -100).sum()) for _, labels, _ in host_batch.values()) - needle_targets
    out = []
    for ids, labels, needle in host_batch.values():
        weight = torch.where(needle, 1 / max(needle_targets, 1), 1 / max(short_targets, 1))
        out.append(tuple(t.to(device, non_blocking=True) for t in (ids, labels, weight)))
    return out


def train_steps(model, args: argparse.Namespace) -> float:
    """Run the optimiser for --steps steps (cut to fit --time-budget); return the last loss."""
    cuda = args.device.startswith("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05,
                                  fused=cuda or None)
    widths = bucket_widths(args.needle_chars, tuple(args.widths))
    rows, batches = training_batches(args, widths)
    log(args, "rows per step by width: " + ", ".join(f"{rows[w]} x {w}" for w in widths))
    args.bucket_rows = {str(w): rows[w] for w in widths}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    # torch.compile fuses the many small kernels of these tiny models; fixed widths keep it to one graph each.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(widths))
    forward = torch.compile(model, dynamic=False) if args.compile else model
    started = timing_start = time.time()
    step, loss = 0, float("nan")
    while step < args.steps:
        if args.time_budget and step == TIMING_STEPS[1]:
            seconds_per_step = (time.time() - timing_start) / (TIMING_STEPS[1] - TIMING_STEPS[0])
            args.steps = steps_for_budget(args, seconds_per_step, time.time() - started)
        if step == TIMING_STEPS[0]:
            timing_start = time.time()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        losses = []
        for input_ids, labels, row_weight in step_batch(next(batches), args.device):  # gradients accumulate
            with autocast, forward_context():
                logits = forward(input_ids=input_ids).logits
            token_loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), reduction="none")
            bucket_loss = (token_loss.view(labels.shape) * row_weight[:, None]).sum()
            bucket_loss.backward()  # one backward per width, so one graph's activations live at a time
            losses.append(bucket_loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps - 1:
            loss = float(sum(losses))
            log(args, f"step {step} loss {loss:.4f} lr {optimizer.param_groups[0]['lr']:.2e} "
                      f"t {time.time() - started:.0f}s")
        if args.eval_every and step and step % args.eval_every == 0:
            evaluated = time.time()
            with torch.no_grad(), autocast, attention_implementation(model, "sdpa"):
                accuracy, _ = evaluate(model, 50, args.needle_chars, args.device, "gold", tuple(args.eval_every_kinds))
            log(args, f"step {step} held-out accuracy (50 each, gold history) {json.dumps(accuracy)} "
                      f"({time.time() - evaluated:.1f} s)")
        step += 1
        args.steps_done = step
    return round(loss, 4)


def save(model, out: str, summary: dict) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    save_tokenizer(out_dir)
    (out_dir / "training.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out_dir / "README.md").write_text(model_card(summary))


def model_card(s: dict) -> str:
    a = s["args"]
    history = "the model's own" if a.get("eval_history", "own") == "own" else "gold"
    rows = "\n".join(f"| {kind} | {acc * 100:.1f}% |" for kind, acc in s["accuracy"].items())
    return f"""# fp8-harness canary: {s['arch']} ({s['model_class']})

A tiny character-level chat model trained from scratch by `harness/canary/train.py` on the synthetic
corpus of `harness/canary/corpus.py`, so that the harness has a model that solves its canary scenarios
in BF16 without any download. Not a language model for anything else.

- Parameters: {s['params']:,} (weights stored in bf16, safetensors)
- Tokenizer: one token per character, chat template `<|role|>content<|end|>` (`harness/canary/tokenizer.py`)
- Data: seeded synthetic dialogues, about {a['short_batch']} short ones per step ({mix_text(a.get('mix', SHORT_KIND_WEIGHTS))})
  and {a['long_batch']} long-context needle dialogues with {a.get('needle_min_chars', corpus.MIN_NEEDLE_CHARS)}-{a['needle_chars']} filler characters, in rows of
  widths {', '.join(map(str, s.get('widths', [])))} by length ({s.get('rows', '')} rows each). Arithmetic `a * b + c * d` with
  operands {corpus.OPERAND_RANGE[0]}..{corpus.OPERAND_RANGE[1]}; one problem in ten (by operand hash) and a disjoint filler seed range are held out of training.
- Loss: cross-entropy on assistant tokens only. AdamW (peak lr {a['lr']}, warm-up {a['warmup']}, cosine to 10%),
  bf16 autocast on CUDA.
- Steps: {s['steps']} ({s.get('interrupted') or 'completed'}), seed {s['seed']}, device {s['device']}, training time {s['train_seconds']} s
- Reproduce: `{command_line(s)}`{earlier_runs(s.get('init'))}
- Versions: {json.dumps(s['versions'])}

## Held-out accuracy at the end of training (greedy, {history} replies as history)

{s['eval_per_kind']} held-out dialogues per task (`corpus.heldout_set(kind, n, seed={HELDOUT_SEED})`); long-context needles at
{a['needle_chars']} filler characters, any depth; rule chats count as correct only if every reply keeps every rule.

| task | accuracy |
|---|---|
{rows}

Accuracy measured by the harness itself on `scenarios/canary/accuracy/` is the number of record.
"""


def mix_text(mix: dict[str, float]) -> str:
    total = sum(mix.values())
    return ", ".join(f"{kind} {share / total:.0%}" for kind, share in mix.items())


def stage_argv(s: dict, out: str = "DIR", init: str | None = "DIR_1", device: str = "cuda") -> list[str]:
    """The options of this script that repeat the training a summary (training.json) describes: the
    ones that change the weights. `init` stands for the run it continued, if it continued one."""
    a = s["args"]
    argv = ["--arch", s["arch"], "--steps", str(s["steps"]), "--seed", str(s["seed"]), "--out", out,
            "--device", device, "--lr", str(a["lr"]), "--warmup", str(a["warmup"]),
            "--short-batch", str(a["short_batch"]), "--long-batch", str(a["long_batch"]),
            "--needle-chars", str(a["needle_chars"]), *(["--compile"] if a.get("compile") else []),
            *(["--needle-min-chars", str(a["needle_min_chars"])]
              if a.get("needle_min_chars", corpus.MIN_NEEDLE_CHARS) != corpus.MIN_NEEDLE_CHARS else []),
            "--widths", ",".join(map(str, a.get("widths", SHORT_BUCKETS))), "--data-workers", str(a.get("data_workers", 0))]
    if a.get("mix", SHORT_KIND_WEIGHTS) != SHORT_KIND_WEIGHTS:
        argv += ["--mix", ",".join(f"{kind}={share:g}" for kind, share in a["mix"].items())]
    return argv + (["--init", init] if a.get("init") and init else [])


def command_line(s: dict) -> str:
    """The command that repeats the run a summary describes; DIR_1 is the run it continued."""
    return "python -m harness.canary.train " + " ".join(stage_argv(s))


def stages(s: dict) -> list[dict]:
    """The runs behind a summary, oldest first, each as a summary that stage_argv takes."""
    chain = [s]
    while chain[-1].get("init"):
        init = chain[-1]["init"]
        chain.append(dict(init, arch=init["args"]["arch"], seed=init["args"]["seed"]))
    return chain[::-1]


def earlier_runs(init: dict | None) -> str:
    """Card lines for the runs this one continued, newest first, each with the command that repeats it."""
    if not init:
        return ""
    earlier = stages({"init": init})[:-1][::-1]  # newest first
    lines = "".join(
        f"\n  - DIR_{n}: {run['steps_done']} steps, {run['train_seconds']} s on {run['device']}:"
        f" `python -m harness.canary.train {' '.join(stage_argv(run, f'DIR_{n}', f'DIR_{n + 1}'))}`"
        for n, run in enumerate(earlier, 1))
    total = sum(run["train_seconds"] for run in earlier)
    return (f"\n- Continued from (newest first; `python -m harness.canary.retrain` repeats them all, {total:.0f} s"
            f" of training before this stage):{lines}")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


def log(args: argparse.Namespace, line: str) -> None:
    print(f"[{args.arch}] {line}", flush=True)


def parse_mix(text: str) -> dict[str, float]:
    """`kind=share,...` over the short kinds; shares are relative (normalised when drawn)."""
    mix = {}
    for item in text.split(","):
        kind, _, share = (part.strip() for part in item.partition("="))
        if kind not in SHORT_KIND_WEIGHTS:
            raise argparse.ArgumentTypeError(f"--mix: unknown kind {kind!r}; expected {list(SHORT_KIND_WEIGHTS)}")
        try:
            mix[kind] = float(share)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--mix: share of {kind!r} must be a number, got {share!r}") from None
        if mix[kind] < 0:
            raise argparse.ArgumentTypeError(f"--mix: share of {kind!r} is negative")
    if not sum(mix.values()):
        raise argparse.ArgumentTypeError("--mix: every share is 0")
    return mix


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--short-batch", type=int, default=64, help="short dialogues per step")
    parser.add_argument("--long-batch", type=int, default=8, help="long-context dialogues per step")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds of training: time steps 10-40 and cut --steps to fit (the card records the count)")
    parser.add_argument("--needle-chars", type=int, default=corpus.MAX_NEEDLE_CHARS,
                        help="longest filler in training and evaluation (smaller for smoke tests)")
    parser.add_argument("--needle-min-chars", type=int, default=corpus.MIN_NEEDLE_CHARS,
                        help="shortest training filler (a run that only needs long contexts learns them faster)")
    parser.add_argument("--eval-per-kind", type=int, default=100, help="held-out dialogues per task at the end")
    parser.add_argument("--eval-history", choices=("own", "gold"), default="own",
                        help="history for held-out turns: the model's own replies (as the harness) or the gold ones (faster)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the training forward (fixed shapes)")
    parser.add_argument("--widths", type=lambda text: [int(w) for w in text.split(",")], default=list(SHORT_BUCKETS),
                        help="row widths for dialogues shorter than the longest needle (comma-separated; one "
                             "compiled graph each)")
    parser.add_argument("--data-workers", type=int, default=4, help="batch-building processes on CUDA (0: inline)")
    parser.add_argument("--init", help="a directory saved by an earlier run of this script to continue from")
    parser.add_argument("--mix", type=parse_mix, default=dict(SHORT_KIND_WEIGHTS),
                        help="shares of the short kinds, e.g. arithmetic=0.5,recall=0.3,chat=0.1,echo=0.1 "
                             f"(default {','.join(f'{k}={w}' for k, w in SHORT_KIND_WEIGHTS.items())})")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=0,
                        help="every N steps, log held-out accuracy of --eval-every-kinds (50 each, gold history)")
    parser.add_argument("--eval-every-kinds", type=parse_kinds, default=["arithmetic", "recall"],
                        help=f"tasks of --eval-every, comma-separated from {','.join(corpus.KINDS)}")
    args = parser.parse_args(argv)
    if not 1 <= args.needle_min_chars <= args.needle_chars:
        parser.error(f"--needle-min-chars {args.needle_min_chars} must be within 1..--needle-chars {args.needle_chars}")
    return args


def parse_kinds(text: str) -> list[str]:
    kinds = [kind.strip() for kind in text.split(",")]
    unknown = [kind for kind in kinds if kind not in corpus.KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown task(s) {unknown}; expected some of {list(corpus.KINDS)}")
    return kinds


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
