"""Measure how far transformers' sdpa_paged kernel is from kvviz's float32 recomputation on clean runs:
the figure kvviz.engine.kernel_check's tolerance (MARGIN) is set from.

    python scripts/kernel_tolerance.py [--models tiny-llama,tiny-gpt2,smollm2] [--long 1500]

Each model runs clean workloads through the transformers backend with engine.kernel sdpa_paged
(chunked prefill and decode, a shared prefix, a long prompt of --long tokens); every layer's check
is recorded, and the largest difference is printed in units of eps * log2(2L) * scale by the number
of keys L the query saw, beside MEASURED_MAX and MARGIN. Timing does not matter here: it runs under
any load.
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict

from kvviz.engine import kernel_check
from kvviz.engine.workload import Workload
from kvviz.models import load_model
from kvviz.runners.checked import run_checked


def workloads(vocab: int, long: int) -> list[tuple[list[list[int]], int, int]]:
    """(prompts as token ids, new tokens each, token budget per batch): three short prompts, two sharing
    a 100-token prefix and a third, a 250-token prompt beside a tiny one, and a long one beside its half."""

    def ids(n: int, seed: int) -> list[int]:
        r = random.Random(seed)
        return [r.randrange(3, vocab) for _ in range(n)]

    shared = ids(100, 9)
    return [
        ([ids(5, 1), ids(20, 2), ids(60, 3)], 8, 64),
        ([shared + ids(30, 4), shared + ids(50, 5), ids(40, 6)], 6, 128),
        ([ids(250, 7), ids(3, 8)], 4, 256),
        ([ids(long, 11), ids(long // 2, 12)], 3, 512),
    ]


def measure(model: str, long: int) -> dict[int, float]:
    """The largest error of every check, by the power of two below L."""
    m = load_model(model, device="cpu")
    long = min(long, m.config.max_position_embeddings - 8)
    worst: dict[int, float] = defaultdict(float)
    check = kernel_check.check

    def spy(query, key, value, visible, scaling, output):
        c = check(query, key, value, visible, scaling, output)
        for n, e in zip(visible.sum(-1).tolist(), c.error.amax(0).tolist(), strict=True):
            bucket = 1 << (n.bit_length() - 1)
            worst[bucket] = max(worst[bucket], e)
        return c

    kernel_check.check = spy
    try:
        for prompts, new, budget in workloads(min(m.config.vocab_size, 10_000), long):
            reqs = [
                {"id": f"R{i}", "prompt_ids": p, "max_new_tokens": new, "arrival_step": i, "ignore_eos": True}
                for i, p in enumerate(prompts)
            ]
            blocks = max(64, sum(len(p) for p in prompts) // 16 + 16)
            engine = {
                "backend": "transformers",
                "kernel": "sdpa_paged",
                "block_size": 16,
                "num_blocks": blocks,
                "max_batch_tokens": budget,
            }
            run = run_checked(m, Workload.from_dict({"requests": reqs, "engine": engine}), reference=False)
            assert not run.findings, run.findings  # a clean run: nothing to find
    finally:
        kernel_check.check = check
    return dict(worst)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny-llama,tiny-gpt2,smollm2")
    p.add_argument("--long", type=int, default=1500, help="tokens in the long prompt (at most the model's positions)")
    args = p.parse_args()
    print(f"MEASURED_MAX {kernel_check.MEASURED_MAX}, MARGIN {kernel_check.MARGIN} (in eps * log2(2L) * scale)")
    for model in args.models.split(","):
        worst = measure(model, args.long)
        rows = "  ".join(f"L {b}-{2 * b - 1}: {e:.3f}" for b, e in sorted(worst.items()))
        print(f"{model}: largest {max(worst.values()):.3f}  by L  {rows}")


if __name__ == "__main__":
    main()
