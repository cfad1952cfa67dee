"""The reference oracle: each request again, alone, through transformers' own attention (or, for an
engine whose arithmetic differs, through that engine alone: llama.cpp's `alone`).

It shares nothing with the engine: one forward of the request's prompt plus the tokens the engine
produced (teacher forcing), batch size 1, the model's stock attention. Comparing the two sets of
logits tells a leak (the request's output moved and it put weight on foreign slots) from batch
variance (logits move within the tolerance, with zero foreign weight): the second is never called a
leak, and a greedy token that flips within the tolerance is a near tie, not a divergence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine import RunResult
from ..models import LoadedModel

# float32: batched and incremental computation of the same attention agree to ~1e-5 on tiny models and
# ~1e-4 on SmolLM2's 30 layers (reduction order); a leak moves logits by whole units.
TOLERANCE = 1e-3


@dataclass(frozen=True)
class Divergence:
    request: str
    first_divergent_step: int | None  # index of the first generated token that differs from alone
    max_logit_diff: float
    max_kl: float
    classification: str  # identical | batch_variance | leak | divergence

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def isolated_logits(model: LoadedModel, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """Logits the model gives each generated position when the request runs alone: [n, V]."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]], device=model.device)
    with torch.inference_mode():
        out = model.model(input_ids=ids, logits_to_keep=len(output_ids)).logits[0]
    return out.float().cpu()


# (requests compared so far, requests to compare, the request being compared now): a run alone per
# request takes seconds on a real model, and a user waiting on it should see which
ReferenceCallback = Callable[[int, int, str], None]


# a request run alone, teacher-forced: (model, prompt ids, output ids) -> [n outputs, V] float32 logits; by
# default through transformers' own cache, for a backend with its own arithmetic (llama.cpp) through it
Alone = Callable[[LoadedModel, list[int], list[int]], torch.Tensor]


def compare_with_isolated(model: LoadedModel, result: RunResult, leaked: dict[str, float],
                          alone: Alone = isolated_logits, tolerance: float = TOLERANCE,
                          on_request: ReferenceCallback | None = None) -> list[Divergence]:
    """One Divergence per request; `leaked` maps request -> its max foreign + stale mass."""
    out = []
    for i, r in enumerate(result.requests):
        if on_request is not None:
            on_request(i, len(result.requests), r.id)
        if r.logits is None:
            raise ValueError("the run kept no logits: run the engine with keep_logits=True")
        if not r.output_ids:
            continue
        ref = alone(model, r.prompt_ids, r.output_ids)
        mine = torch.stack(r.logits)
        diff = (mine - ref).abs().amax(-1)
        kl = torch.nn.functional.kl_div(mine.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1)
        moved = [i for i, d in enumerate(diff.tolist()) if d > tolerance]  # a greedy flip within it is a near tie
        first = min(moved) if moved else None
        worst = float(diff.max())
        if leaked.get(r.id, 0.0) > 0:
            label = "leak"
        elif first is not None:
            label = "divergence"
        else:
            label = "identical" if worst == 0 else "batch_variance"
        out.append(Divergence(r.id, first, round(worst, 8), round(max(0.0, float(kl.max())), 8), label))  # KL >= 0
    return out


def divergence_summary(divs: list[Divergence]) -> dict:
    return {
        "diverged_requests": sum(d.first_divergent_step is not None for d in divs),
        "max_logit_diff": max((d.max_logit_diff for d in divs), default=0.0),
    }
