"""Measure how far a stress variant is from its base canary in BF16: logits of every scenario's first prompt.

    python -m harness.canary.check_variant harness/canary/weights/stress/mla-latent-2048 [--scenarios DIR]

Prints one line per variant: prompts compared, prompts with bit-identical logits, max |logit difference|,
and the amax of what the cache stores (base vs variant), so a card can state the measured BF16 difference.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from harness.kv_paths.cache import observer_cache
from harness.replay.inprocess import InProcessModel
from harness.scenarios.sources import load_scenarios
from harness.types import Message

DEFAULT_SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios" / "canary" / "accuracy"


def first_prompt(scenario) -> list[Message]:
    system = [Message("system", scenario.system)] if scenario.system else []
    return system + [Message("user", scenario.turns[0].user)]


def bf16_difference(variant_dir: Path, prompts: list[list[Message]]) -> dict:
    variant = InProcessModel.load(variant_dir)
    if variant.variant is None:
        raise SystemExit(f"{variant_dir} holds no variant.json")
    base = InProcessModel.load(variant.variant.base)
    identical, worst = 0, 0.0
    amax = {"base": 0.0, "variant": 0.0}
    for chat in prompts:
        ids = base.encode_chat(chat)
        caches = {"base": observer_cache(base.model.config), "variant": observer_cache(variant.model.config)}
        logits_base = base._forward(ids, caches["base"])
        logits_variant = variant._forward(ids, caches["variant"])
        identical += bool(torch.equal(logits_base, logits_variant))
        worst = max(worst, (logits_base - logits_variant).abs().max().item())
        for name, cache in caches.items():
            amax[name] = max([amax[name]] + [float(layer.k_amax.max()) for layer in cache.layers
                                             if getattr(layer, "k_amax", None) is not None])
    return {"variant": str(variant_dir), "prompts": len(prompts), "identical": identical, "max_abs_logit_diff": worst,
            "k_amax_base": amax["base"], "k_amax_variant": amax["variant"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", type=Path)
    parser.add_argument("--scenarios", type=Path, default=DEFAULT_SCENARIOS)
    args = parser.parse_args(argv)
    prompts = [first_prompt(s) for s in load_scenarios([args.scenarios])]
    print("| variant | prompts | bit-identical logits | max abs logit diff | cached amax base -> variant |")
    print("|---|---:|---:|---:|---|")
    for directory in args.variants:
        r = bf16_difference(directory, prompts)
        print(f"| {Path(r['variant']).name} | {r['prompts']} | {r['identical']} | {r['max_abs_logit_diff']:g} | "
              f"{r['k_amax_base']:.3g} -> {r['k_amax_variant']:.3g} |")


if __name__ == "__main__":
    main()
