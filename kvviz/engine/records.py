"""What the engine reports: each request's result, each step's record and the run's totals."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import EngineConfig
from .events import BlockEvent
from .kv_cache import PoolSnapshot


@dataclass(frozen=True, kw_only=True)
class KVTransfer:
    """A prefilled request's K/V sent from the prefill instance to the decode instance."""

    request: str
    blocks: int
    bytes: int
    status: str  # what the transfer reported: "ok" (a failed one that says ok is a fault)
    from_blocks: tuple[int, ...] = ()  # the prefill instance's blocks sent
    to_blocks: tuple[int, ...] = ()  # the decode instance's blocks that received them
    kv_of: tuple[str, ...] = ()  # who wrote the K/V the received slots hold (see KVCacheManager.received)
    intact: bool = True  # every received slot holds this request's own tokens' K/V at its position


@dataclass(frozen=True, kw_only=True)
class Lookup:
    """A request's prefix-cache lookup at admission: what a hit rate counts and a miss is explained by."""

    tokens: int  # prompt tokens looked up
    hit_tokens: int  # served by the cache
    salt: str | None


@dataclass(kw_only=True)
class RequestResult:
    id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str  # "eos", "length" or "cancelled"
    cached_tokens: int  # prompt tokens served by the prefix cache on first admission
    arrival_step: int
    first_token_step: int
    finish_step: int
    logits: list[torch.Tensor] | None = None  # one float32 [V] row per generated token, on request
    first_token_seconds: float = 0.0  # since the run started: time to first token, queueing included
    finish_seconds: float = 0.0

    @property
    def seconds_per_output_token(self) -> float:
        """Mean time between this request's tokens after the first (TPOT), 0 for one token."""
        n = len(self.output_ids) - 1
        return (self.finish_seconds - self.first_token_seconds) / n if n > 0 else 0.0


@dataclass(kw_only=True)
class StepRecord:
    """What one step did, for recorders and progress displays."""

    step: int
    work: dict[str, tuple[int, int]]  # request -> (first position computed, tokens computed)
    admitted: list[str]
    preempted: list[str]
    sampled: dict[str, int]
    finished: list[str]
    writes: dict[str, list[int]] = field(default_factory=dict)  # request -> slots its K/V went to, by position
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request -> token ids computed, by position
    events: list[BlockEvent] = field(default_factory=list)
    lookups: dict[str, Lookup] = field(default_factory=dict)  # each admitted request's prefix-cache lookup
    snapshot: PoolSnapshot | None = None  # the pool after the step's frees
    transfers: list[KVTransfer] = field(default_factory=list)  # disaggregated: requests handed to decode
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # sampling request -> its float32 [V] row, on request
    seconds: float = 0.0


@dataclass
class RunStats:
    steps: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0  # prompt positions actually computed (recomputes included)
    cached_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


@dataclass(kw_only=True)
class RunResult:
    run_id: str
    config: EngineConfig
    requests: list[RequestResult]
    stats: RunStats = field(default_factory=RunStats)
    notes: list[str] = field(default_factory=list)  # what the backend said of the run once it ran

    def summary(self) -> dict:
        s = self.stats
        return {
            "run_id": self.run_id,
            "engine": self.config.to_dict(),
            "requests": [{"id": r.id, "output_ids": r.output_ids, "text": r.text, "finish_reason": r.finish_reason,
                          "cached_tokens": r.cached_tokens} for r in self.requests],
            "stats": {"steps": s.steps, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                      "prefill_tokens_computed": s.prefill_tokens_computed, "generated_tokens": s.generated_tokens,
                      "preemptions": s.preemptions, "seconds": round(s.seconds, 4),
                      "tokens_per_second": round(s.tokens_per_second, 2)},
        }
