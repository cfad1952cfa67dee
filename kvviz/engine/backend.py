"""The seam every engine plugs into: kvviz's own loop, transformers' continuous batching observed,
llama.cpp observed. A backend computes; the driver (driver.py) owns what every backend shares: the
arrival loop, each request's result and the run's totals.

A backend admits requests, runs one step when asked and reports what the step did as a StepRecord
(who computed which positions, what each request sampled, who finished, the cache after the step),
handing its attention to observers as the step runs. It decides when a request ends (its EOS or its
length) because it must stop computing it; everything said about the request afterwards is the
driver's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .records import StepRecord
from .workload import RequestSpec, WorkloadError


class EngineError(WorkloadError):
    """The workload cannot run on this backend (it says which step or request, and why)."""


@dataclass(frozen=True, kw_only=True)
class Admission:
    """What a backend made of a request it admitted."""

    prompt_ids: list[int]  # the whole prompt it runs: a fork's or a resumed session's history first
    cached_tokens: int | None = None  # known at admission (a fork shares its parent's); None: its lookup says


class Backend(Protocol):
    """One engine under kvviz's driver."""

    step: int  # the number the next step gets; the driver moves it past idle steps
    notes: list[str]  # what it says of the run once it ran (a misuse that never struck), for the run's record

    @property
    def busy(self) -> bool:
        """Requests are running or waiting: another step has work."""

    def add(self, spec: RequestSpec, own_ids: list[int], generator: torch.Generator | None = None) -> Admission:
        """A request arrives now with its own prompt's token ids (a parent's history is the backend's to
        add); `generator` draws its samples (by default one seeded by the run's seed and its id)."""

    def advance(self, snapshot: bool = False, logits: bool = False) -> StepRecord | None:
        """Run one step; None when no request is there (EngineError when requests are there but none can
        run). `snapshot`: the cache after the step goes on the record; `logits`: each sampling request's
        logits row does (the reference oracle's input)."""

    def cancel(self, request_id: str) -> bool:
        """Stop a request where it is and free what it holds; False when it is not running or waiting."""

    def forget(self, request_id: str) -> None:
        """Drop what is kept of an ended request (its history, for forks of it): a server keeps none."""
