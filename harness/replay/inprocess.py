"""In-process backend: a transformers causal LM, run with the reference cache or a KV path's cache.

Every backend of one `InProcessModel` shares its weights; only the cache layers differ, so the `bf16`
path must match the reference bit for bit. Attention runs through a registered attention function
(`harness`), the one place where per-layer observers and kernel swaps attach. A backend generates and scores
through the one in-process engine (`harness.replay.batched.BatchedEngine`), a sequence alone being a batch of one
row (`ONE_SEQUENCE`).
"""

from __future__ import annotations

import copy
import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from harness.canary.tiny_models import RANDOM_WEIGHTS_MARKER
from harness.canary.variants import apply_variant, read_variant
from harness import model_layers
from harness.forward_context import forward_context
from harness.kv_paths import attention, decode_kernels
from harness.kv_paths.attention import ATTENTION_NAME
from harness.kv_paths.cache import (
    ChannelRangeObserverLayer,
    LayerScales,
    build_cache,
    cache_kwargs,
    latent_row_formats,
    observer_cache,
    scales_from_checkpoint,
    scales_from_observers,
    unit_scales,
)
from harness.kv_paths.format_faults import DUMMY_PASS_FAULTS
from harness.kv_paths.spec import KVPath
from harness.replay import cpu_exact
from harness.replay.batched import ONE_SEQUENCE, BatchedEngine
from harness.replay.route import ModelFacts, Route, decide
from harness.types import Generation, Message, Scores

attention.register()

# Token ids of encoded chats kept per model (8 bytes each: 64 MiB): a memory bound, not a tuning knob. A replay
# encodes each chat once per path and per lookup (the batched replay about 8 times per turn); an 8B model's
# 16k-token needle prompt takes 128 KiB here.
CHAT_CACHE_TOKENS = 1 << 23
# KV bytes of post-prefill caches a backend keeps for scoring the same prompt (`PrefillMemo`, CPU): a memory bound,
# not a tuning knob (a canary turn's cache is ~1 MB; an 8B model's 2k-token prompt, 256 MiB, still fits one)
PREFILL_MEMO_BYTES = 1 << 28


# (directory, each hashed file's name, size and mtime) -> its digest: a model's description is asked for by every
# path's backend (the default run hashed its three canaries 40 times; `benchmarks/phase_time.py --device cuda
# --profile` on an H200 box put 1.05 s in hashlib's updates, session 39); a file that changes changes the key
_DIGESTS: dict[tuple, str] = {}
_DIGESTS_LOCK = threading.Lock()


def sha256_of_dir(directory: Path) -> str:
    """sha256 over the names and bytes of a model directory's weight and JSON files (sorted), read again only when
    one of them changed (size or modification time) since this process last hashed it."""
    files = [file for file in sorted(Path(directory).rglob("*"))
             if file.is_file() and file.suffix in (".safetensors", ".json", ".bin")]
    key = (str(Path(directory).resolve()), *((file.name, *_size_and_time(file)) for file in files))
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    with _DIGESTS_LOCK:
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def _size_and_time(file: Path) -> tuple[int, int]:
    found = file.stat()
    return found.st_size, found.st_mtime_ns


@dataclass
class InProcessModel:
    """A loaded model plus its tokenizer; hands out one backend per KV path."""

    directory: Path
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    arch: str
    random_weights: bool
    calibration_chats: list = field(default_factory=list)  # list[list[Message]]; empty = defaults
    use_kernels: bool = False  # decode of FP8 paths through our Triton kernels (CUDA)
    variant: object = None  # harness.canary.variants.Variant when loaded from a stress variant's folder
    scales_file: Path | None = None  # ':checkpoint' scales from this file instead of the model directory
    kernel_block: str | None = None  # why our decode kernels must not run for this family (replay/families.py)
    shard_plan: object = None  # harness.replay.sharding.ShardPlan: the layers split over several GPUs
    tensor_parallel: bool = False  # one rank of a tensor-parallel group (harness.replay.tensor_parallel)
    cpu_shortcuts: dict = field(default_factory=dict)  # harness.replay.cpu_exact.install's account
    _scales: dict[tuple, object] = field(default_factory=dict)  # LayerScales by path key; observer caches (_observed)
    _encodings: "EncodingCache" = field(default_factory=lambda: EncodingCache(), repr=False, compare=False)
    _float32: "InProcessModel | None" = field(default=None, repr=False, compare=False)
    _facts: ModelFacts | None = field(default=None, repr=False, compare=False)

    @property
    def facts(self) -> ModelFacts:
        """What the route reads of this model's config (`route.ModelFacts`), read once: the loaded model's config
        does not change, and reading it walks every layer."""
        if self._facts is None:
            self._facts = ModelFacts.of(self.model.config)
        return self._facts

    @classmethod
    def load(cls, directory: str | Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
             shard: str | None = None) -> "InProcessModel":
        """`shard="layers"` with several GPUs (`device="cuda:0,1"`): the decoder layers split over them in one
        process (`harness.replay.sharding`); input ids go to the first GPU, each layer's cache and kernels stay on
        its own."""
        from transformers import AutoTokenizer

        from harness.replay import families

        directory = Path(directory)
        variant = read_variant(directory)  # a stress variant: its base's weights, reparametrised
        weights = variant.base if variant is not None else directory
        if not (weights / "config.json").is_file():
            raise FileNotFoundError(f"model directory {directory} has no config.json")
        kernel_block = families.check_loadable(weights)  # refuses a family it cannot replay (ValueError)
        tokenizer = AutoTokenizer.from_pretrained(str(weights))
        random_weights = (weights / RANDOM_WEIGHTS_MARKER).exists()
        plan = None
        if shard == "tensor":  # this process is one rank of a tensor-parallel group (tensor_parallel.init_rank)
            from harness.replay import tensor_parallel

            rank, size = tensor_parallel.world()
            device = tensor_parallel.split_world(device)[rank] if "," in device else device
            model = tensor_parallel.load(weights, dtype, ATTENTION_NAME, random_weights, device)
        elif shard is not None:
            from harness.replay import sharding

            devices = sharding.split_devices(device)
            sharding.check_shard(shard, devices)
            model, plan = sharding.load_sharded(weights, devices, dtype, ATTENTION_NAME, random_weights)
            device = devices[0]  # where input ids go: the embeddings' GPU
        else:  # AutoModelForCausalLM, or the family's own class where transformers maps none (Mistral 4, ...)
            model = families.load_model(weights, dtype=dtype, attn_implementation=ATTENTION_NAME)
        if variant is not None:
            apply_variant(model, variant)
        if plan is None and shard != "tensor":  # a tensor-parallel rank's slices are on its device already
            model.to(device)
        model.eval()
        families.check_model(model, tokenizer, str(directory))  # state the KV paths cannot hold: refused before work
        exact = cpu_exact.install(model)  # bit-exact CPU shortcuts, each probed on this machine first
        wanted = decode_kernels.kernels_setting()  # auto | off | reference (torch stand-ins, any device)
        use_kernels = wanted == "reference" or (wanted == "auto" and torch.device(device).type == "cuda")
        return cls(directory=directory, model=model, tokenizer=tokenizer, device=torch.device(device),
                   arch=model.config.model_type, random_weights=random_weights,
                   use_kernels=use_kernels, variant=variant, kernel_block=kernel_block, shard_plan=plan,
                   tensor_parallel=shard == "tensor", cpu_shortcuts=exact)

    def describe(self) -> dict:
        described = {"path": str(self.directory), "sha256": sha256_of_dir(self.directory), "arch": self.arch,
                     "random_weights": self.random_weights, "dtype": str(next(self.model.parameters()).dtype),
                     "parameters": sum(p.numel() for p in self.model.parameters())}
        if self.cpu_shortcuts:
            described["cpu_shortcuts"] = self.cpu_shortcuts
        if self.variant is not None:
            described["variant"] = {**self.variant.describe(), "base_sha256": sha256_of_dir(self.variant.base)}
        return described

    def backend(self, kv_path: KVPath | None, label: str | None = None) -> "InProcessBackend":
        from harness.replay.families import fp8_attention_refusal

        refusal = fp8_attention_refusal(self.model.config, [kv_path]) if kv_path is not None else None
        if refusal:  # what the loaded model's attention showed (families.check_model): before any work
            raise ValueError(f"model {self.directory}: {refusal}")
        if kv_path is not None and kv_path.is_reference_noise:
            return InProcessBackend(self.in_float32(), kv_path, None, label or kv_path.name)
        scales = self.scales_for(kv_path) if kv_path is not None else None
        label = label or (kv_path.name if kv_path else "reference")
        if self.tensor_parallel:  # the rank's caches take its heads' scales; the manifest states the whole vector
            from harness.replay.tensor_parallel import local_scales

            return InProcessBackend(self, kv_path, local_scales(scales), label, stated_scales=scales)
        return InProcessBackend(self, kv_path, scales, label)

    def in_float32(self) -> "InProcessModel":
        """This model with its weights in float32 (a copy, made once: twice the bf16 weights' memory, on top of
        them), the `fp32` path's model: the BF16 reference's own precision noise."""
        import copy
        import dataclasses

        if self.model.dtype == torch.float32:
            return self
        if self._float32 is None:
            twin = copy.deepcopy(self.model).float()
            cpu_exact.drop_packed(twin)  # the in-order bf16 linear layers become plain ones again
            self._float32 = dataclasses.replace(self, model=twin, _scales={}, _float32=None)
        return self._float32

    # -- tokens ---------------------------------------------------------------------------------------
    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """The chat template's prompt ids (a fresh list; the same chat is encoded once, then kept)."""
        chat = tuple((m.role, m.content) for m in messages)
        return self._encodings.bound_to(self.tokenizer).chat_ids(chat, lambda: self._encode_chat(chat))

    def _encode_chat(self, chat: tuple[tuple[str, str], ...]) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": role, "content": content} for role, content in chat],
                                                  add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text, `tokenizer.decode([t])`, decoded once per token id."""
        return self._encodings.bound_to(self.tokenizer).token_texts(token_ids)

    # -- scales ---------------------------------------------------------------------------------------
    def scales_for(self, kv_path: KVPath) -> LayerScales | None:
        if kv_path.fault in DUMMY_PASS_FAULTS:
            return self._dummy_pass_scales(kv_path)
        if kv_path.is_quantized and not kv_path.has_static_scale:  # every scale computed at write
            return None
        if kv_path.emulated:  # the yardstick's twin computes its own (harness/kv_paths/emulated.py)
            key = ("twin", kv_path.fmt, kv_path.granularity, kv_path.scale_source)
            if key not in self._scales:
                self._scales[key] = self._twin_scales(kv_path)
            return self._scales[key]
        key = (kv_path.fmt, kv_path.v_fmt, kv_path.granularity, kv_path.scale_source, kv_path.hadamard)
        if key not in self._scales:
            scales = self._compute_scales(kv_path)
            # one scale for the latent and k_pe where both take it (FP8; a bf16 path's unused, or class 3's, scales)
            one_row = self.is_mla and (not kv_path.is_quantized or latent_row_formats(kv_path)[1] is not None)
            self._scales[key] = _one_scale_per_latent(scales) if one_row else scales
        if kv_path.quantizes_attention and self._scales[key] is not None:
            return self._with_attention_scales(kv_path, self._scales[key])
        return self._scales[key]

    def _with_attention_scales(self, kv_path: KVPath, scales: LayerScales) -> LayerScales:
        """The path's q_scale / prob_scale per attention layer, from its scale source (see spec.py)."""
        import dataclasses

        from harness.kv_paths import calibration
        from harness.kv_paths.cache import attention_layer_indices
        from kernels.reference import amax_scale

        layers = attention_layer_indices(self.model.config)
        source = kv_path.scale_source
        key = ("attention", source)
        if key not in self._scales:
            if source == "default":
                q = {i: torch.tensor(1.0) for i in layers}
                prob = dict(q)
            elif source == "checkpoint":
                where = self.scales_file or self.directory
                found = calibration.attention_scales_from_checkpoint(
                    calibration.checkpoint_tensors(where), layers, str(where), ("q_scale", "prob_scale"))
                q, prob = found["q_scale"], found["prob_scale"]
            else:
                with calibration.query_amax(self.model) as amax:
                    if source == "calibrated":
                        for chat in self.calibration_chats or calibration.default_calibration_chats():
                            self._observe(self.encode_chat(chat), observer_cache(self.model.config))
                    else:
                        with calibration.uninitialised_recurrent_state(self.model):
                            self._observe(calibration.dummy_warmup_ids(self.tokenizer), observer_cache(self.model.config))
                if self.tensor_parallel:  # each rank saw its query heads: the max over every rank's
                    from harness.replay.tensor_parallel import max_across_ranks

                    amax = max_across_ranks(amax)
                q = {i: amax_scale(amax[i], "e4m3") for i in layers}
                prob = {i: amax_scale(torch.tensor(1.0), "e4m3") for i in layers}  # amax of P is 1
            self._scales[key] = LayerScales(k={}, v={}, source=source, q=q, prob=prob)
        extra = self._scales[key]
        return dataclasses.replace(scales, q=extra.q, prob=extra.prob)

    def _dummy_pass_scales(self, kv_path: KVPath) -> LayerScales:
        """The path's scales from its own source, with each channel's (min, max) over one dummy warm-up pass (the
        recurrent state uninitialised, as failure class 2's): fault=dummy_block_scales freezes block scales there."""
        import dataclasses

        from harness.kv_paths import calibration

        key = ("dummy pass", kv_path.fmt, kv_path.v_fmt, kv_path.granularity, kv_path.scale_source)
        if key not in self._scales:
            static = self.scales_for(dataclasses.replace(kv_path, fault=""))
            cache = observer_cache(self.model.config, ChannelRangeObserverLayer)
            with calibration.uninitialised_recurrent_state(self.model):
                self._observe(calibration.dummy_warmup_ids(self.tokenizer), cache)
            observed = [(i, layer) for i, layer in enumerate(cache.layers) if getattr(layer, "k_range", None) is not None]
            base = static or LayerScales(k={}, v={}, source=kv_path.scale_source, provenance="computed at write")
            self._scales[key] = dataclasses.replace(
                base, k_dummy_range={i: layer.k_range for i, layer in observed},
                v_dummy_range={i: layer.v_range for i, layer in observed},
                provenance=base.provenance + "; block scales frozen from one dummy warm-up pass (fault injector)")
        return self._scales[key]

    @property
    def is_mla(self) -> bool:
        return model_layers.field(self.model.config, "kv_lora_rank") is not None

    def _compute_scales(self, kv_path: KVPath) -> LayerScales | None:
        from harness.kv_paths import calibration

        config = self.model.config
        if kv_path.scale_source == "default":
            return unit_scales(config)
        if kv_path.scale_source == "checkpoint":
            where = self.scales_file or self.directory
            return scales_from_checkpoint(calibration.checkpoint_tensors(where), config, kv_path, str(where))
        if kv_path.scale_source == "calibrated":
            chats = self.calibration_chats or calibration.default_calibration_chats()
            return scales_from_observers(self._observed("calibrated", kv_path.hadamard), kv_path, "calibrated",
                                         f"amax over {len(chats)} calibration chats", self.is_mla)
        if kv_path.scale_source == "warmup":
            return scales_from_observers(self._observed("warmup", kv_path.hadamard), kv_path, "warmup",
                                         "one dummy warm-up pass, recurrent state uninitialised (failure class 2)",
                                         self.is_mla)
        raise ValueError(f"KV path {kv_path.name!r}: unknown scale source {kv_path.scale_source!r}")

    def _observed(self, source: str, rotated: bool):
        """The observer cache (`AmaxObserverLayer`s: each attention layer's K and V amax per head) after the passes
        of a scale source: the calibration chats ("calibrated") or one dummy warm-up pass ("warmup"); `rotated`:
        K's amax as a `hadamard` path stores it. Observed once per model and kept with its scales: a path's format
        and granularity only read it (`scales_from_observers`: amax is exact, per tensor the max over heads), so
        the default run's per-tensor and per-head calibrated paths share one set of passes and get the scales their
        own passes gave."""
        from harness.kv_paths import calibration

        key = ("observed", source, rotated)
        if key not in self._scales:
            config = self.model.config
            cache = observer_cache(config, rotated=rotated)
            if source == "calibrated":
                for chat in self.calibration_chats or calibration.default_calibration_chats():
                    self._observe(self.encode_chat(chat), cache)  # amax over all of them, carried
                    cache = _carry_amax(cache, observer_cache(config, rotated=rotated))
            else:
                with calibration.uninitialised_recurrent_state(self.model):
                    self._observe(calibration.dummy_warmup_ids(self.tokenizer), cache)
            self._gather_amax(cache)
            self._scales[key] = cache
        return self._scales[key]

    def _twin_scales(self, kv_path: KVPath) -> LayerScales:
        """The twin's scales from its own calibration pass: the same calibration chats through caches of its own
        layers, which record the amax of what they are given (`emulated.twin_scales`); none of the engine's."""
        from harness.kv_paths import calibration
        from harness.kv_paths.emulated import twin_scales

        observed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        chats = self.calibration_chats or calibration.default_calibration_chats()
        for chat in chats if kv_path.scale_source == "calibrated" else chats[:1]:
            cache = build_cache(self.model.config, kv_path, None)
            self._observe(self.encode_chat(chat), cache)
            self._gather_amax(cache)
            for i, layer in enumerate(cache.layers):
                if getattr(layer, "k_amax", None) is not None:
                    seen = observed.get(i)
                    observed[i] = (layer.k_amax, layer.v_amax) if seen is None else (
                        torch.maximum(seen[0], layer.k_amax), torch.maximum(seen[1], layer.v_amax))
        scales = twin_scales(observed, kv_path.fmt, kv_path.granularity, kv_path.scale_source, self.is_mla)
        return LayerScales(k={i: k for i, (k, _) in scales.items()}, v={i: v for i, (_, v) in scales.items()},
                           source=kv_path.scale_source, provenance=f"the twin's own pass over {len(chats)} "
                           f"calibration chats (harness/kv_paths/emulated.py)")

    def _gather_amax(self, cache) -> None:
        """A tensor-parallel rank's per-head amax (its KV heads) made the whole [H] vector of every rank's heads,
        so the scales (per tensor: the max over it) are those of a one-GPU run."""
        if self.tensor_parallel:
            from harness.replay.tensor_parallel import gather_head_amax

            gather_head_amax(cache)

    @torch.inference_mode()
    def _observe(self, ids: list[int], cache) -> None:
        """A forward pass for what the cache (or the attention observers) see; only the last position's
        logits are computed (an 8B model's [T, 128k] fp32 logits of a 4k-token chat would be 2 GiB)."""
        with forward_context(cache=cache):
            self.model(input_ids=torch.tensor([ids], device=self.device), **cache_kwargs(self.model, cache),
                       use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def _forward(self, ids: list[int], cache) -> torch.Tensor:
        input_ids = torch.tensor([ids], device=self.device)
        with forward_context(cache=cache):
            return self.model(input_ids=input_ids, **cache_kwargs(self.model, cache), use_cache=True).logits[0].float()


class EncodingCache:
    """What one tokenizer gave, kept: chat prompt ids (LRU, at most `max_tokens` ids, stored as int64 arrays)
    and single-token texts (at most one per vocabulary entry). Tokenisation is a pure function of the tokenizer
    and its input; another tokenizer (`bound_to`) empties the cache."""

    def __init__(self, max_tokens: int = CHAT_CACHE_TOKENS):
        self.max_tokens, self.held, self.tokenizer = max_tokens, 0, None
        self.chats: OrderedDict[tuple, array] = OrderedDict()
        self.texts: dict[int, str] = {}
        self.lock = threading.Lock()  # `harness serve` may tokenise from its thread pool

    def bound_to(self, tokenizer) -> "EncodingCache":
        with self.lock:
            if tokenizer is not self.tokenizer:
                self.tokenizer, self.held = tokenizer, 0
                self.chats.clear()
                self.texts.clear()
        return self

    def chat_ids(self, chat: tuple, encode: Callable[[], list[int]]) -> list[int]:
        with self.lock:
            found = self.chats.get(chat)
            if found is not None:
                self.chats.move_to_end(chat)
                return found.tolist()
        ids = list(encode())  # outside the lock: another thread may encode the same chat meanwhile, same ids
        with self.lock:
            if chat not in self.chats:
                self.chats[chat] = array("q", ids)
                self.held += len(ids)
            while self.held > self.max_tokens and len(self.chats) > 1:  # oldest first; the newest always stays
                self.held -= len(self.chats.popitem(last=False)[1])
        return ids

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        texts = self.texts  # dict reads and single stores are atomic; a token decoded twice gives the same text
        for t in token_ids:
            if t not in texts:
                texts[t] = self.tokenizer.decode([t])
        return [texts[t] for t in token_ids]


def _one_scale_per_latent(scales: LayerScales) -> LayerScales:
    """MLA engines keep [latent | k_pe] in one cache with one scale: use max(k_scale, v_scale) for both."""
    merged = {i: torch.maximum(scales.k[i].max(), scales.v[i].max()) for i in scales.k if i in scales.v}
    return LayerScales(k=merged, v=dict(merged), source=scales.source,
                       provenance=scales.provenance + "; one scale per MLA latent cache")


def _carry_amax(used, fresh):
    """A fresh observer cache (empty KV) that keeps the running amax of `used`."""
    for old, new in zip(used.layers, fresh.layers):
        if hasattr(old, "k_amax"):
            new.k_amax, new.v_amax = old.k_amax, old.v_amax
    return fresh


class InProcessBackend:
    """One model + one KV path (`None` = the reference cache)."""

    def __init__(self, owner: InProcessModel, kv_path: KVPath | None, scales: LayerScales | None, label: str,
                 stated_scales: LayerScales | None = None):
        self.owner, self.kv_path, self.scales, self.label = owner, kv_path, scales, label
        # what describe() states: the scales of every head (a tensor-parallel rank's `scales` are its heads')
        self.stated_scales = stated_scales if stated_scales is not None else scales
        self.prefills = PrefillMemo(PREFILL_MEMO_BYTES)

    def describe(self) -> dict:
        described = {"label": self.label, "kind": "in-process", "model": str(self.owner.directory)}
        if self.kv_path is not None:
            described.update(path=self.kv_path.canonical, description=self.kv_path.describe())
        if self.stated_scales is not None:
            described["scales"] = self.stated_scales.summary()
        described["decode_kernel"] = self.route.kernel_label
        return described

    @property
    def route(self) -> Route:
        """This path's route on this model and device (`harness.replay.route`; decided once, then looked up)."""
        return decide(self.kv_path, self.owner.model.config, self.owner.device.type, self.owner.use_kernels,
                      facts=self.owner.facts)

    def new_cache(self):
        """A fresh cache for this backend's path (the model's own cache for the reference)."""
        return build_cache(self.owner.model.config, self.kv_path, self.scales)

    async def generate(self, messages: Sequence[Message], max_new_tokens: int) -> Generation:
        return self.generate_sync(messages, max_new_tokens)

    async def score(self, messages: Sequence[Message], continuation_ids: Sequence[int]) -> Scores:
        return self.score_sync(messages, continuation_ids)

    async def aclose(self) -> None:
        return None

    async def attention_error(self, messages: Sequence[Message], continuation_ids: Sequence[int], options):
        return self.attention_error_sync(messages, continuation_ids, options)

    def attention_error_sync(self, messages: Sequence[Message], continuation_ids: Sequence[int], options):
        """Attention-score error of this path against the reference on the reference's continuation
        (`harness.replay.attention.measure_turn`); the reference backend has nothing to compare."""
        from harness.replay.attention import AttentionTurn, measure_turn

        if self.kv_path is None:
            return AttentionTurn(summary={}, rows=[], channels=[], sampled={})
        kernel = self.route.kernel  # its rows beside torch's
        return measure_turn(self.owner.model, self.owner.device, self.kv_path, self.scales,
                            self.owner.encode_chat(messages), list(continuation_ids), options, kernel=kernel)

    @torch.inference_mode()
    def generate_sync(self, messages: Sequence[Message], max_new_tokens: int) -> Generation:
        """Greedy decoding: prefill the prompt, then one token per step through the same cache."""
        prompt = self.owner.encode_chat(messages)
        token_ids, finish_reason, metrics = self.greedy_ids(prompt, max_new_tokens, remember_prefill=True)
        tokenizer = self.owner.tokenizer
        return Generation(token_ids=token_ids, text=tokenizer.decode(token_ids), finish_reason=finish_reason,
                          tokens=self.owner.token_texts(token_ids), prompt_tokens=len(prompt),
                          metrics=metrics)

    def engine(self) -> BatchedEngine:
        """The in-process engine for one sequence alone (a batch of one row: `batched.ONE_SEQUENCE`)."""
        return BatchedEngine(self, ONE_SEQUENCE, prefills=self.prefills)

    def greedy_ids(self, prompt_ids: Sequence[int], max_new_tokens: int,
                   on_step: Callable[[torch.Tensor, int], None] | None = None,
                   remember_prefill: bool = False) -> tuple[list[int], str, dict | None]:
        """Token-level greedy decoding (also `harness serve`'s): returns (token ids, finish reason
        "eos" | "length" | "nonfinite_logits", cast, kernel and implementation-check metrics). `on_step(logits,
        next_id)` sees each step's logits before the token is taken. remember_prefill: keep a copy of the cache and
        the last logits after the prompt's prefill, for `score_sync` of the same prompt (the replay scores each
        turn's reference reply on the prompt it generated from, in reference-history mode)."""
        row = self.engine().generate_one(prompt_ids, max_new_tokens, on_step, remember_prefill)
        return row.token_ids, row.finish_reason, row.metrics

    def score_sync(self, messages: Sequence[Message], continuation_ids: Sequence[int]) -> Scores:
        """Log-probs of each continuation token given everything before it: [T, V] float32.

        Prompt and continuation are written as two chunks, so every continuation token attends to the
        quantised cache as in decoding. A `raw_prefill` path feeds the continuation one token at a time,
        since there a multi-token chunk would attend to its own raw K/V, which decoding never does.
        """
        prompt = self.owner.encode_chat(messages)
        [logprobs] = self.engine().score([prompt], [list(continuation_ids)])
        return Scores(logprobs=logprobs)


class PrefillMemo:
    """Copies of a backend's cache and last-position logits right after a prompt's prefill, kept for scoring the
    same prompt: the score's own prefill would be the same forward pass on the same input over a fresh cache of
    the same path, so its results are bit for bit these. At most `max_bytes` of KV (estimated), oldest dropped;
    a cache that cannot be copied is not kept (scoring then prefills itself)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.held = max_bytes, 0
        self.entries: OrderedDict[tuple, tuple] = OrderedDict()
        self.lock = threading.Lock()  # `harness serve` may generate from its thread pool

    def put(self, prompt: tuple, cache, last_logits: torch.Tensor, size: int) -> None:
        if size > self.max_bytes:
            return
        try:
            kept = (copy.deepcopy(cache), last_logits.clone(), size)
        except Exception:  # noqa: BLE001 - e.g. a layer holding a module; scoring prefills itself
            return
        with self.lock:
            old = self.entries.pop(prompt, None)
            self.held += size - (old[2] if old else 0)
            self.entries[prompt] = kept
            while self.held > self.max_bytes and self.entries:
                self.held -= self.entries.popitem(last=False)[1][2]

    def take(self, prompt: tuple) -> tuple:
        """(cache, last logits [1, V]) of this prompt's prefill, once; (None, None) when none is kept."""
        with self.lock:
            found = self.entries.pop(prompt, None)
            if found is None:
                return None, None
            self.held -= found[2]
            return found[0], found[1]
