"""Every input of `harness run` checked before the first unit, and before the run directory is touched.

A bad `--model`, `--tokenizer`, `--out`, endpoint URL or `--api-key-env` is refused at once, all problems
together, one line each naming the flag and the value: never after another model's whole replay, and
never leaving a "failed" run directory that blocks the same `--out`. Scenario files are checked by
`harness.scenarios.load` (also before anything is built); path specs by `harness.kv_paths.spec`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from harness.canary.variants import VARIANT_FILE, VariantError, read_variant
from harness.records import scrub_credentials
from harness.replay.live import candidate_labels  # noqa: F401 - where `harness run` reads --candidate

if TYPE_CHECKING:
    from harness.run_config import RunConfig


class InputError(ValueError):
    """One or more refused inputs; the message has one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems) if len(problems) == 1 else
                         f"{len(problems)} problems with the run's inputs:\n" + "\n".join(problems))


def check_run_inputs(config: RunConfig) -> None:
    problems = [*_out_problems(config.out, config.resume)]
    for directory in config.models:  # with --scales, :checkpoint paths read that file instead of the model's
        problems += _model_problems(Path(directory)) or (
            [] if config.scales_file else _checkpoint_scale_problems(Path(directory), config.paths)) or (
            _family_problems(Path(directory), config.paths))
    if config.shard == "tensor":
        problems += _tensor_parallel_problems(config)
    if config.scales_file is not None and not Path(config.scales_file).is_file():
        problems.append(f"--scales {config.scales_file}: no such file (k_scale/v_scale safetensors, or SGLang's "
                        f"quantization-param JSON, as harness calibrate writes)")
    problems += _endpoint_problems(config)
    for path in config.calibration_paths:
        if not Path(path).exists():
            problems.append(f"--calibration {path}: no such file or directory (scenario files whose chats "
                            f"calibrate 'calibrated' scales)")
    if config.jobs < 1:
        problems.append(f"--jobs {config.jobs}: must be at least 1")
    if config.executor == "ray" and importlib.util.find_spec("ray") is None:
        problems.append("--executor ray: Ray is not installed here (pip install 'fp8-harness[ray]', on every node "
                        "of the cluster too)")
    problems += _ray_address_problems(config.ray_address)
    if problems:
        raise InputError(problems)


def _ray_address_problems(address: str | None) -> list[str]:
    """A HOST:PORT that nothing answers on is refused at once: Ray itself waits minutes for a cluster that is not
    there. `auto` and `ray://` addresses are left to Ray."""
    import socket

    if address is None or address == "auto" or "://" in address:
        return []
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return [f"--ray-address {address}: expected HOST:PORT (the head node's GCS, e.g. 10.0.0.1:6379), auto, or "
                f"ray://HOST:PORT"]
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, OverflowError) as error:
        return [f"--ray-address {address}: no Ray cluster answers there ({error}); start one with "
                f"`ray start --head --port {port}` on {host}"]
    return []


def _out_problems(out: Path, resume: bool) -> list[str]:
    out = Path(out)
    if out.exists() and not out.is_dir():
        return [f"--out {out}: is a file, not a run directory"]
    parent = next((p for p in out.parents if p.exists()), Path("."))
    if not out.exists() and not os.access(parent, os.W_OK):
        return [f"--out {out}: cannot create it ({parent} is not writable)"]
    if not out.exists():
        try:  # writable by mode bits is not enough (/proc, /sys, a read-only mount): make and remove a probe
            os.rmdir(tempfile.mkdtemp(prefix=".harness-probe-", dir=parent))
        except OSError as error:
            return [f"--out {out}: cannot create a directory in {parent} ({error.strerror or error})"]
    if resume and not (out / "manifest.json").is_file():
        return [f"--out {out}: nothing to resume there (no manifest.json); drop --resume to start a new run"]
    return []


def scenario_budget_problems(scenarios: Sequence, models: Sequence[Path]) -> list[str]:
    """A scenario whose `generation.max_new_tokens`, or whose prompt with it, does not fit a model's context
    (its config.json's max_position_embeddings): refused before the replay, as `harness serve` and vLLM refuse
    such a request with a 400, rather than decoding until an end-of-sequence token that may never come or
    running positions the model was never built for."""
    problems = []
    for directory in models:
        context = _context_length(_weights_directory(Path(directory)))
        if context is None:
            continue
        no_room = [s for s in scenarios if s.max_new_tokens >= context]
        problems += [f"{s.source}: scenario {s.id!r}: field 'generation.max_new_tokens': {s.max_new_tokens} leaves "
                     f"no room for the prompt in model {directory}'s context of {context} tokens "
                     f"(max_position_embeddings)" for s in no_room]
        problems += prompt_length_problems([s for s in scenarios if s.max_new_tokens < context], Path(directory),
                                           context)
    return problems


def prompt_length_problems(scenarios: Sequence, directory: Path, context: int) -> list[str]:
    """Each scenario's first turn whose chat-templated prompt plus `max_new_tokens` is beyond `context`. The
    prompt is the turn's fixed text with every earlier generated reply counted at its `max_new_tokens`: the
    most the replay can hand the model."""
    tokenizer = _tokenizer(_weights_directory(directory))
    if tokenizer is None:
        return []  # no tokenizer to count with: the model's own checks name it
    problems = []
    count = PromptCounter(tokenizer, context)
    for scenario in scenarios:
        turn, prompt = _first_turn_beyond(scenario, count, context)
        if turn is not None:
            problems.append(f"{scenario.source}: scenario {scenario.id!r}: turn {turn}: prompt of {prompt} tokens "
                            f"+ generation.max_new_tokens {scenario.max_new_tokens} is beyond model {directory}'s "
                            f"context of {context} tokens (max_position_embeddings; earlier generated replies "
                            f"counted at max_new_tokens)")
    return problems


def _first_turn_beyond(scenario, count: "PromptCounter", context: int) -> tuple[int | None, str]:
    """(the first turn whose longest prompt + reply is beyond `context`, that prompt's tokens as text), else
    (None, ""). A turn's prompt holds every earlier one's, so only when the last turn is beyond are the others
    counted."""
    if count.longest_prompt(scenario, len(scenario.turns) - 1)[0] + scenario.max_new_tokens <= context:
        return None, ""
    for turn in range(len(scenario.turns)):
        tokens, exact = count.longest_prompt(scenario, turn)
        if tokens + scenario.max_new_tokens > context:
            return turn, f"{tokens}" if exact else f"at least {tokens}"
    return None, ""


class PromptCounter:
    """Tokens of a turn's chat-templated prompt. A text longer than the context could hold even in the widest
    vocabulary entries is not tokenised (a 1,000,000-character filler took 20 s): its count is a lower bound."""

    def __init__(self, tokenizer, context: int):
        self.tokenizer, self.context = tokenizer, context
        self.widest = max(map(len, tokenizer.get_vocab()), default=1)  # characters per token, at most

    def longest_prompt(self, scenario, upto: int) -> tuple[int, bool]:
        """(tokens of turn `upto`'s prompt: system, earlier turns with a generated reply counted as its
        `max_new_tokens`, its user text; whether that count is exact rather than a lower bound)."""
        chat = [{"role": "system", "content": scenario.system}] if scenario.system else []
        generated = 0
        for turn in scenario.turns[:upto]:
            chat += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.assistant or ""}]
            generated += turn.assistant is None
        chat.append({"role": "user", "content": scenario.turns[upto].user})
        text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        replies = generated * scenario.max_new_tokens
        if len(text) > self.context * self.widest:
            return -(-len(text) // self.widest) + replies, False
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + replies, True


def _weights_directory(directory: Path) -> Path:
    """Where a model's config and tokenizer are: a stress variant's base canary, else the directory itself."""
    try:
        variant = read_variant(directory)
    except VariantError:
        return directory  # refused by _model_problems
    return variant.base if variant is not None else directory


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception:  # noqa: BLE001 - any tokenizer that will not load is named when the model loads
        return None


def _context_length(directory: Path) -> int | None:
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a stress variant (derived at load time) or a model _model_problems already refused
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def _model_problems(directory: Path) -> list[str]:
    if not directory.is_dir():
        return [f"--model {directory}: no such directory (a local transformers model directory)"]
    if (directory / VARIANT_FILE).is_file():  # a stress variant: derived from its base canary at load time
        try:
            read_variant(directory)
        except VariantError as error:
            return [f"--model {directory}: {error}"]
        return []
    config = directory / "config.json"
    if not config.is_file():
        return [f"--model {directory}: no config.json there; not a transformers model directory"]
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return [f"--model {directory}: config.json is not valid JSON ({error})"]
    return []


def _family_problems(directory: Path, paths) -> list[str]:
    """A model family or layer kind the KV paths cannot replay (harness/replay/families.py), from its config."""
    from harness.replay.families import config_of, refusals

    try:
        config = config_of(directory)
    except ValueError as error:  # "model DIR: transformers cannot read its config.json (...)"
        return [f"--{error}"]
    return [f"--model {directory}: {problem}" for problem in refusals(config, paths)] if config is not None else []


def _tensor_parallel_problems(config: RunConfig) -> list[str]:
    """A family transformers has no tensor-parallel plan for, or heads that do not split over the ranks."""
    from harness.replay.families import config_of
    from harness.replay.tensor_parallel import refusal

    problems = []
    for directory in config.models:
        try:
            model_config = config_of(Path(directory)) if Path(directory).is_dir() else None
        except ValueError:  # named by _family_problems
            continue
        why = refusal(model_config, len(config.shard_devices)) if model_config is not None else None
        if why:
            problems.append(f"--model {directory}: --shard tensor: {why}")
    return problems


def _checkpoint_scale_problems(directory: Path, paths) -> list[str]:
    """A `:checkpoint` FP8 path needs k_scale/v_scale tensors: looked up in the safetensors headers now,
    not after the model has loaded (harness/kv_paths/cache.py names any layer still missing later)."""
    wanted = [p.name for p in paths if p.has_static_scale and p.scale_source == "checkpoint"]
    if not wanted:
        return []
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                if any(name.endswith(("k_scale", "v_scale")) for name in handle.keys()):
                    return []
        except Exception as error:  # noqa: BLE001 - a broken weights file: say which
            return [f"--model {directory}: cannot read {file.name} ({type(error).__name__}: {error})"]
    return [f"--paths {','.join(wanted)}: model {directory} has no k_scale/v_scale tensors in its *.safetensors "
            f"(a checkpoint scale source needs them)"]


def _endpoint_problems(config: RunConfig) -> list[str]:
    from harness.replay.endpoint import normalise_base_url

    problems = []
    urls = [("--reference", config.reference_url), ("--judge", config.judge_url)]
    try:
        urls += [("--candidate", url) for _, url in candidate_labels(config.candidate_urls)]
    except ValueError as error:
        problems.append(str(error))
    for flag, url in urls:
        if url is None:
            continue
        try:
            normalise_base_url(url)
        except ValueError as error:
            problems.append(f"{flag} {scrub_credentials(url)}: {error}")
    if config.api_key_env and not os.environ.get(config.api_key_env):
        problems.append(f"--api-key-env {config.api_key_env}: that environment variable is not set (keys are read from the environment only)")
    if config.tokenizer:
        problems += _tokenizer_problems(config.tokenizer)
    return problems


def _tokenizer_problems(name: str) -> list[str]:
    """A local directory must exist; anything else must load now (offline: a hub name not in the cache fails)."""
    path = Path(name).expanduser()
    if name.startswith(("/", ".", "~")) and not path.is_dir():
        return [f"--tokenizer {name}: no such directory"]
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name)
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds; the user needs the reason
        return [f"--tokenizer {name}: cannot load it ({type(error).__name__}: {str(error).splitlines()[0][:200]})"]
    return []
