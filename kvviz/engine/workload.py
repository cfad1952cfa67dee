"""Workload files: the requests to run, the engine settings and the seed, validated field by field.

{"requests": [{"id": "A", "prompt": "text" | "prompt_ids": [..], "max_new_tokens": 16,
  "arrival_step": 0, "cache_salt": "tenant-1", "adapter": "adapter name", "parent": "id to fork from",
  "truncate": 12, "temperature": 0.0, "top_p": 1.0, "ignore_eos": false, "cancel_step": null}],
 "engine": {"block_size": 16, "num_blocks": 256, "max_batch_tokens": 256, "isolation": "paged",
  "compute": "inspect", "prefix_caching": true, "backend": "kvviz"},
 "seed": 0}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import WorkloadError  # the message starts with the path of the offending field
from ..util.jsonio import parse_json
from .config import ConfigError, EngineConfig

MAX_WORKLOAD_BYTES = 64 << 20


@dataclass(frozen=True)
class RequestSpec:
    id: str
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 16
    arrival_step: int = 0
    cache_salt: str | None = None
    adapter: str | None = None  # a LoRA-style adapter name: a namespace of the cache and of the K/V content
    parent: str | None = None  # fork from this request (share its blocks), or with `truncate` resume its session
    truncate: int | None = None  # resubmit the parent's session cut to its first N tokens (all when
    # shorter), then this prompt
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)
    cancel_step: int | None = None  # the client goes away before this step (a disconnect, a timeout)


@dataclass(frozen=True)
class Workload:
    requests: list[RequestSpec]
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 0

    @classmethod
    def from_dict(cls, d: object) -> Workload:
        if not isinstance(d, dict):
            raise WorkloadError(f"workload: must be a JSON object, got {type(d).__name__}")
        _no_unknown(d, {"requests", "engine", "seed"}, "workload")
        reqs = d.get("requests")
        if not isinstance(reqs, list) or not reqs:
            raise WorkloadError("requests: must be a non-empty list of request objects")
        specs: list[RequestSpec] = []
        for i, r in enumerate(reqs):
            try:
                specs.append(_request(r, f"requests[{i}]", {s.id: s for s in specs}))
            except WorkloadError as e:  # counted from 0 above; name the request as an editor shows it too
                rid = r.get("id") if isinstance(r, dict) else None
                if isinstance(rid, str) and rid.strip():
                    raise WorkloadError(f"{e} (request {rid!r}, row {i + 1})") from None
                raise
        engine = d.get("engine", {})
        if not isinstance(engine, dict):
            raise WorkloadError("engine: must be an object of engine settings")
        try:
            cfg = EngineConfig.from_dict(engine)
        except (ConfigError, TypeError) as e:
            raise WorkloadError(f"engine.{e}") from None
        seed = d.get("seed", 0)
        if not _is_int(seed) or seed < 0:
            raise WorkloadError(f"seed: must be a non-negative integer, got {seed!r}")
        return cls(specs, cfg, seed)

    @classmethod
    def from_file(cls, path: str | Path) -> Workload:
        p = Path(path)
        try:
            if p.stat().st_size > MAX_WORKLOAD_BYTES:
                raise WorkloadError(f"{p}: {p.stat().st_size} bytes; a workload file holds at most "
                                    f"{MAX_WORKLOAD_BYTES >> 20} MiB")
            data = p.read_bytes()
        except FileNotFoundError:
            raise WorkloadError(f"{p}: no such workload file") from None
        except OSError as e:
            raise WorkloadError(f"{p}: cannot read the workload file: {e.strerror or e}") from None
        return cls.from_dict(parse_json(data, str(p), WorkloadError))

    def to_dict(self) -> dict:
        reqs = [{k: v for k, v in asdict(r).items() if v is not None} for r in self.requests]
        return {"requests": reqs, "engine": self.engine.to_dict(), "seed": self.seed}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _no_unknown(d: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise WorkloadError(f"{where}.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")


def _request(r: object, where: str, earlier: dict[str, RequestSpec]) -> RequestSpec:
    if not isinstance(r, dict):
        raise WorkloadError(f"{where}: must be an object, got {type(r).__name__}")
    _no_unknown(r, {f.name for f in fields(RequestSpec)}, where)
    rid = r.get("id")
    if not isinstance(rid, str) or not rid.strip():
        raise WorkloadError(f"{where}.id: must be a non-empty string, got {rid!r}")
    if rid in earlier:
        first = list(earlier).index(rid)
        raise WorkloadError(f"{where}.id: {rid!r} is already the id of requests[{first}] (row {first + 1}); "
                            "each request needs an id of its own")
    prompt, ids, parent = r.get("prompt"), r.get("prompt_ids"), r.get("parent")
    if prompt is not None and ids is not None:
        raise WorkloadError(f"{where}: give prompt or prompt_ids, not both")
    if prompt is not None and not isinstance(prompt, str):
        raise WorkloadError(f"{where}.prompt: must be a string, got {type(prompt).__name__}")
    if ids is not None and (not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids)):
        raise WorkloadError(f"{where}.prompt_ids: must be a list of non-negative integer token ids")
    if parent is None and not prompt and not ids:
        raise WorkloadError(f"{where}: needs a non-empty prompt or prompt_ids (or a parent to fork from)")
    if r.get("truncate") is not None and parent is None:
        raise WorkloadError(f"{where}.truncate: cuts the parent's session; give the parent to resume")
    if r.get("truncate") == 0 and not prompt and not ids:
        raise WorkloadError(f"{where}: truncate 0 keeps none of the parent's tokens; give a prompt")
    checks = {
        "max_new_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
        "arrival_step": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        "cache_salt": (lambda v: v is None or isinstance(v, str), "a string or null"),
        "adapter": (lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "a non-empty string or null"),
        "truncate": (lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0 or null"),
        "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
        "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
        "cancel_step": (lambda v: v is None or (_is_int(v) and v > r.get("arrival_step", 0)),
                        "null or an integer after arrival_step"),
    }
    for name, (ok, what) in checks.items():
        if name in r and not ok(r[name]):
            raise WorkloadError(f"{where}.{name}: must be {what}, got {r[name]!r}")
    if parent is not None:
        if parent not in earlier:
            raise WorkloadError(f"{where}.parent: {parent!r} is not an earlier request in the list")
        p = earlier[parent]
        if r.get("arrival_step", 0) < p.arrival_step:
            raise WorkloadError(f"{where}.arrival_step: a fork cannot arrive before its parent {parent!r}")
        for name in ("cache_salt", "adapter"):
            if r.get(name) not in (None, getattr(p, name)):
                raise WorkloadError(f"{where}.{name}: a fork or a resumed session keeps its parent's {name}; "
                                    f"omit it or use {getattr(p, name)!r}")
        r = {**r, "cache_salt": p.cache_salt, "adapter": p.adapter}
    return RequestSpec(**r)
