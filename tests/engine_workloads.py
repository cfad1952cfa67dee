"""Workloads that exercise every engine feature, and the reference they must reproduce."""

from __future__ import annotations

import torch

from kvviz.engine.workload import Workload

TEXT = (
    "The seven colours of the rainbow are red, orange, yellow, green, cyan, blue and violet. "
    "A paged KV cache splits every request's keys and values into fixed-size blocks that live in "
    "one shared pool; page tables map logical positions to physical blocks, reference counts say "
    "how many requests hold each block, and a prefix cache lets requests with the same system "
    "prompt reuse blocks that another request already computed. Copy-on-write keeps forks apart. "
    "红 橙 黄 绿 青 蓝 紫. Once upon a time a small model learned to count: one, two, three, four."
)


def slices(tokenizer, lengths: list[int]) -> list[list[int]]:
    ids = tokenizer(TEXT).input_ids
    out = []
    for i, n in enumerate(lengths):
        start = (i * 37) % (len(ids) - n)
        out.append(ids[start:start + n])
    return out


def workloads(tokenizer) -> dict[str, dict]:
    """Name -> workload dict (without isolation/compute, which the tests vary)."""
    mixed = slices(tokenizer, [3, 17, 40, 9, 64, 25])
    system = slices(tokenizer, [24])[0]
    tails = slices(tokenizer, [5, 7, 4, 9])
    fork = slices(tokenizer, [13, 3])
    tight = slices(tokenizer, [10, 11, 9, 12])
    return {
        "mixed_lengths_late_arrivals_chunked": {
            "requests": [{"id": f"m{i}", "prompt_ids": p, "max_new_tokens": n, "arrival_step": a}
                         for i, (p, n, a) in enumerate(zip(mixed, [8, 5, 12, 6, 4, 10], [0, 0, 1, 3, 4, 6],
                                                           strict=True))],
            "engine": {"block_size": 8, "num_blocks": 64, "max_batch_tokens": 24},
        },
        "shared_prefix_with_and_without_salt": {
            "requests": [
                {"id": "s1", "prompt_ids": system + tails[0], "max_new_tokens": 6, "cache_salt": "t1"},
                {"id": "s2", "prompt_ids": system + tails[1], "max_new_tokens": 6, "cache_salt": "t1",
                 "arrival_step": 2},
                {"id": "s3", "prompt_ids": system + tails[2], "max_new_tokens": 6, "cache_salt": "t2",
                 "arrival_step": 2},
                {"id": "s4", "prompt_ids": system + tails[3], "max_new_tokens": 6, "arrival_step": 3},
                {"id": "s5", "prompt_ids": system + tails[3], "max_new_tokens": 4, "arrival_step": 4},
            ],
            "engine": {"block_size": 4, "num_blocks": 64, "max_batch_tokens": 64},
        },
        "forks_copy_on_write": {
            "requests": [
                {"id": "p", "prompt_ids": fork[0], "max_new_tokens": 10},
                {"id": "c1", "parent": "p", "prompt_ids": fork[1], "max_new_tokens": 6, "arrival_step": 3},
                {"id": "c2", "parent": "p", "max_new_tokens": 5, "arrival_step": 5},
                {"id": "c3", "parent": "c1", "max_new_tokens": 4, "arrival_step": 6},
            ],
            "engine": {"block_size": 4, "num_blocks": 64, "max_batch_tokens": 64},
        },
        "preemption_under_a_tight_pool": {
            "requests": [{"id": f"t{i}", "prompt_ids": p, "max_new_tokens": 12} for i, p in enumerate(tight)],
            "engine": {"block_size": 4, "num_blocks": 10, "max_batch_tokens": 32},
        },
    }


def make(workload: dict, isolation: str, compute: str) -> Workload:
    d = {**workload, "engine": {**workload["engine"], "isolation": isolation, "compute": compute}}
    return Workload.from_dict(d)


def reference(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """The request alone through transformers' own generate and cache: tokens and logits."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=model.tokenizer.eos_token_id)
    return out.sequences[0, ids.shape[1]:].tolist(), [row[0].float().cpu() for row in out.logits]
