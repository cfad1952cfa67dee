"""`kvviz serve --record`: the served traffic recorded into the run store like any run (every step's
pool, the oracle's metrics and findings, each request as it ends), one run per server life, marked
complete at shutdown or failed with the reason. For a session of audits or a bug hunt, not for days:
every step writes every block of the pool."""

from __future__ import annotations

import time

from ..engine import EngineConfig, RequestResult, StepRecord
from ..engine.workload import Workload
from ..models import LoadedModel
from ..oracle import ProvenanceOracle
from ..oracle.provenance import Finding
from ..store import RunStore
from ..store.recorder import RunRecorder
from ..util.ids import new_run_id


class ServedRecording:
    def __init__(self, store: RunStore, model: LoadedModel, config: EngineConfig, fault: str | None,
                 oracle: ProvenanceOracle | None):
        self.run_id, self.started = new_run_id(), time.perf_counter()
        self.recorder = RunRecorder(store, self.run_id, model=model, workload=Workload([], config), scenario="serve",
                                    fault=fault, oracle=oracle)
        self.recorder.drain_oracle = True
        self.config, self.requests, self.findings = config, [], 0

    def on_step(self, rec: StepRecord, findings: list[Finding]) -> None:
        self.recorder.on_step(rec)
        self.add_findings(findings)

    def add_findings(self, findings: list[Finding]) -> None:
        """Findings that will not change any more (a cross-tenant read is written once it has ended)."""
        self.recorder.add_findings(findings)
        self.findings += len(findings)

    def on_request(self, result: RequestResult, salt: str | None, max_tokens: int, temperature: float,
                   top_p: float, ignore_eos: bool) -> None:
        """A request that ended (finished, stopped or cancelled), and its line in the run's workload."""
        self.recorder.add_request(result, salt)
        self.requests.append({"id": result.id, "prompt_ids": result.prompt_ids, "max_new_tokens": max_tokens,
                              "arrival_step": result.arrival_step, "cache_salt": salt, "temperature": temperature,
                              "top_p": top_p, "ignore_eos": ignore_eos})

    def complete(self, steps: int, generated: int, max_foreign: float | None, leak_rate: float | None) -> None:
        self.recorder.complete(steps, time.perf_counter() - self.started, generated, max_foreign, leak_rate,
                               self.findings, {"requests": self.requests, "engine": self.config.to_dict(), "seed": 0})

    def fail(self, error: BaseException) -> None:
        self.recorder.fail(error)
