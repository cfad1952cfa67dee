"""Next-token choice: greedy by default; temperature and top-p from a per-request seeded
generator, so a run with the same seed samples the same tokens."""

from __future__ import annotations

import hashlib

import torch


def request_generator(seed: int, request_id: str, device: torch.device) -> torch.Generator:
    """A generator that depends only on the run's seed and the request's id, not on batching."""
    digest = hashlib.sha256(f"{seed}/{request_id}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def is_eos(token: int, spec, eos_ids: set[int]) -> bool:
    """The token ends its request (an EOS, unless the request ignores EOS)."""
    return token in eos_ids and not spec.ignore_eos


def ends(token: int, generated: int, spec, eos_ids: set[int]) -> bool:
    """A request that has just sampled `token`, its `generated`th, stops here: at EOS or at its length."""
    return is_eos(token, spec, eos_ids) or generated >= spec.max_new_tokens


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from a [V] logits row, at a temperature above 0 (greedy rows take their argmax, which
    the loop finds for every row of a step at once)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the smallest set whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
