"""The search behind the routing bounds of eager mixture-of-experts experts (docs/audit.md, "low" and "high").

With transformers' ``eager`` experts the step's peak depends on how many tokens each expert gets. vramguard
reports three forced routings (:data:`vramguard.workload.routing.ROUTINGS`): ``same`` as the low,
``skewed`` as the high, ``balanced`` between. That they are the extremes is not proven; this script is the
search that found them. For each tiny MoE preset (with ``experts_implementation: eager``) it estimates one
step on meta with the CPU's kernels (each equals the CPU audit forced to the same routing, to the byte:
``tests/test_moe.py``) for the three named routings and for ``--random`` random per-expert token counts
(every expert at most every token, ``tokens x top_k`` in all, the same counts in every layer), and prints
the lowest and highest step peak found against ``same`` and ``skewed``. Exit 1 when a count beats them.

    PYTHONPATH=src python docs/scripts/routing_search.py                 # 200 random counts a preset
    PYTHONPATH=src python docs/scripts/routing_search.py --random 20 --presets tiny-mixtral
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

PRESETS = ("tiny-mixtral", "tiny-qwen3-moe")
SEQ_LEN, BATCH = 64, 2


def random_counts(rng: random.Random, tokens: int, top_k: int, experts: int) -> tuple[int, ...]:
    """``tokens x top_k`` choices spread over ``experts`` experts at random, none over ``tokens``: a random
    order of the experts, each given a random share of what is left (within what the rest can still take)."""
    left, counts = tokens * top_k, [0] * experts
    order = rng.sample(range(experts), experts)
    for i, e in enumerate(order):
        rest = experts - i - 1  # experts after this one, each able to take at most `tokens`
        low, high = max(0, left - rest * tokens), min(tokens, left)
        counts[e] = left if rest == 0 else rng.randint(low, high)
        left -= counts[e]
    return tuple(counts)


def search(preset: str, n: int, seed: int) -> dict[str, object]:
    """The named routings' step peaks and the lowest / highest of ``n`` random counts, for ``preset``."""
    from vramguard.estimate.run import run_estimate
    from vramguard.workload.families import experts_of
    from vramguard.workload.models import ModelSpec, QLoRAConfig, presets
    from vramguard.workload.routing import ROUTINGS, step_peak

    data = json.loads(presets()[preset].read_text())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{preset}-eager.json"
        path.write_text(json.dumps({**data, "experts_implementation": "eager"}))
        config = QLoRAConfig(model=str(path), seq_len=SEQ_LEN, batch=BATCH)

        def peak(routing: object) -> int:
            return step_peak(run_estimate(config, steps=1, target="cpu", routing=routing))  # type: ignore[arg-type]

        named = {kind: peak(kind) for kind in ROUTINGS}
        moe = experts_of(ModelSpec.load(path).transformers_config())
        if moe is None:
            raise SystemExit(f"{preset}: no mixture of experts in its config")
        rng = random.Random(seed)
        tokens = SEQ_LEN * BATCH
        found = [(peak(c), c) for c in (random_counts(rng, tokens, moe.top_k, moe.count) for _ in range(n))]
    low, high = min(found), max(found)
    return {"preset": preset, "named": named, "random": n, "low": low, "high": high}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random", type=int, default=200, help="random per-expert counts a preset (default 200)")
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    beaten = False
    print("| preset | same (low) | balanced | skewed (high) | random counts | lowest found | highest found |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for preset in args.presets:
        r = search(preset, args.random, args.seed)
        named = r["named"]
        (low, _), (high, _) = r["low"], r["high"]  # type: ignore[misc]
        print(
            f"| {preset} | {named['same']:,} | {named['balanced']:,} | {named['skewed']:,} | {r['random']} "
            f"| {low:,} | {high:,} |"
        )
        if low < named["same"] or high > named["skewed"]:
            beaten = True
            print(
                f"{preset}: a random routing beats the named bounds: {r['low']} / {r['high']}",
                file=sys.stderr,
            )
    return 1 if beaten else 0


if __name__ == "__main__":
    sys.exit(main())
