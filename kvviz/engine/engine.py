"""The engine: a model, pool settings and defences; runs a workload to completion on one loop, or
opens a loop that requests join one by one (a server's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..models import LoadedModel
from ..models.queue import WaitCallback
from ..util.ids import new_run_id
from .backend import EngineError
from .config import EngineConfig
from .defences import Defences
from .driver import Driver
from .loop import EngineLoop
from .observer import AttentionObserver
from .records import RunResult, StepRecord
from .workload import RequestSpec, Workload, WorkloadError

__all__ = ["Engine", "EngineError"]


def eos_ids(model: LoadedModel) -> set[int]:
    """The tokens that end a request: the generation config's and the tokenizer's EOS."""
    gen = model.model.generation_config
    eos = gen.eos_token_id if gen is not None else None
    out = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if model.tokenizer.eos_token_id is not None:
        out.add(model.tokenizer.eos_token_id)
    return out


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, defences: Defences | None = None):
        self.model, self.config, self.defences = model, config, defences or Defences()
        self.eos_ids = eos_ids(model)

    def run(self, workload: Workload, on_step: Callable[[StepRecord], None] | None = None,
            observers: Sequence[AttentionObserver] = (), keep_logits: bool = False,
            run_id: str | None = None, on_wait: WaitCallback | None = None) -> RunResult:
        """Run every request of the workload to completion; steps are numbered from 0. Observers
        see every layer's attention probabilities, which only the inspect path computes. The run
        waits its turn on the model (on_wait hears how many runs are ahead)."""
        self._own_backend()
        if observers and self.config.compute != "inspect":
            raise EngineError("attention observers (the leak oracle) need compute='inspect'")
        specs = self.resolve(workload)
        with self.model.queue.turn(on_wait), torch.inference_mode():
            driver = self.open(workload.seed, observers, keep_logits)  # times count from the turn
            return driver.run(specs, self.config, run_id or new_run_id(), on_step)

    def open(self, seed: int = 0, observers: Sequence[AttentionObserver] = (), keep_logits: bool = False) -> Driver:
        """The engine under a driver that requests join one by one between steps (a server's); the caller
        holds the model's turn and torch's inference mode around its steps."""
        self._own_backend()
        loop = EngineLoop(self.model, self.config, self.defences, self.eos_ids, seed, observers)
        return Driver(loop, self.model.tokenizer, self.eos_ids, keep_logits)

    def _own_backend(self) -> None:
        """A workload for another backend never runs here by mistake (replaying, serving it)."""
        if self.config.backend != "kvviz":
            raise EngineError(f"engine.backend: {self.config.backend!r} is another engine, run by "
                              "kvviz.runners.backends, not kvviz's own")

    # -- requests ------------------------------------------------------------------------------
    def check(self, workload: Workload) -> None:
        """Refuse a workload this model and pool cannot run (WorkloadError), before anything starts."""
        self.resolve(workload)

    def resolve(self, workload: Workload, room: tuple[int, str] | None = None) -> list[tuple[RequestSpec, list[int]]]:
        """Token ids of each request's own prompt, checked against the vocabulary and the pool (or `room`: the
        most one request may hold and the words that say so, where a backend gives each request less)."""
        tok, cfg = self.model.tokenizer, self.config
        vocab = self.model.config.vocab_size
        max_pos = getattr(self.model.config, "max_position_embeddings", None) or getattr(self.model.config,
                                                                                         "n_positions", None)
        out, longest = [], {}
        for i, s in enumerate(workload.requests):
            ids = list(s.prompt_ids) if s.prompt_ids is not None else (tok(s.prompt).input_ids if s.prompt else [])
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise WorkloadError(f"requests[{i}].prompt_ids: token {bad[0]} is outside the model's vocabulary "
                                    f"(size {vocab})")
            history = longest.get(s.parent, 0)
            longest[s.id] = (history if s.truncate is None else min(history, s.truncate)) + len(ids) + s.max_new_tokens
            pool = cfg.num_blocks * cfg.block_size
            capacity, holds = room or (pool, f"the pool holds {pool} ({cfg.num_blocks} blocks x {cfg.block_size})")
            if longest[s.id] > capacity:
                raise WorkloadError(f"requests[{i}]: may reach {longest[s.id]} tokens but {holds}; "
                                    "raise engine.num_blocks")
            if max_pos and longest[s.id] > max_pos:
                raise WorkloadError(f"requests[{i}]: may reach {longest[s.id]} tokens, beyond the model's "
                                    f"{max_pos} positions")
            out.append((s, ids))
        return out

