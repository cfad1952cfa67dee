"""The provenance oracle: every attention weight classified as own, foreign or stale.

It runs inside the inspect path on the model's device, and judges from facts alone (slot
provenance recorded when K/V were written, each request's own prefix ids): never from the masks or
page tables it is checking. A key slot s is *own* for a query of request q at position j iff s was
written in its block's current lifetime, pos(s) <= j and prefix_id(s) == p_q(pos(s)); otherwise it
is *foreign* (written by another prefix, attributed to its writer) or *stale* (not written in this
lifetime).

A key that is own by content but was written under another tenant's salt (a prefix block shared
across tenants) is no attention leak: the weights are right, a trust boundary is crossed. It is
reported per block, not per attention row: one `cross_tenant` finding per (reader request, physical
block, run of consecutive steps that read it), for every layer at once (the block holds every
layer's K/V), with no head or mass.

What a server says it served is checked against what the oracle saw (`telemetry_mismatch`): a request
whose first forward starts at position s was served s tokens from the cache, whatever its reply's
cached-token count says; the writer of its first served slot names whose K/V it was.

A kernel that returns no weights (transformers' sdpa_paged) is judged from weights recomputed for it;
how far its output is from theirs comes to on_kernel_check, and past the tolerance it is a
`kernel_mismatch` (those weights are not the ones the kernel used) naming request, layer and head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.attention import AttentionGroup
from ..engine.observer import StepContext

KINDS = ("foreign", "stale", "normalisation", "non_finite", "cross_tenant", "duplicate", "kernel_mismatch",
         "telemetry_mismatch")


@dataclass(frozen=True)
class OracleConfig:
    threshold: float = 1e-6  # foreign/stale/cross-tenant mass that counts as a leak in one row
    norm_tolerance: float = 1e-4  # |1 - own mass| allowed when no foreign or stale mass explains it


@dataclass
class Finding:
    """The worst instance of one kind of anomaly for one request, step and source; or, for
    cross_tenant, one block another tenant wrote that a request read at steps step..last_step
    (layer, head and mass None: every layer, no attention figure; position: its first query that
    read the block; source_request: the writer of the first slot read); or, for telemetry_mismatch,
    a request's first step, the tokens it was served (position: where its first forward started), the
    writer of its first served slot and the cached tokens its reply reported (mass)."""

    kind: str
    request: str
    step: int
    layer: int | None
    head: int | None
    position: int
    source_request: str | None
    mass: float | None
    block: int | None = None  # cross_tenant: the physical block read
    last_step: int | None = None  # the last step the finding spans (a cross_tenant read grows while it goes on)

    def __post_init__(self) -> None:
        if self.last_step is None:
            self.last_step = self.step

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class StepLeak:
    """One step's oracle metrics per (request, layer, head), reduced over that request's queries."""

    step: int
    requests: list[str]
    max_foreign: torch.Tensor  # [R, layers, H] max over queries of foreign + stale mass
    sum_foreign: torch.Tensor  # [R, layers, H]
    leak_rows: torch.Tensor  # [R, layers, H] queries whose foreign + stale mass > threshold
    sum_entropy: torch.Tensor  # [R, layers, H] positional entropy (nats), summed over queries
    rows: list[int]  # queries per request this step


@dataclass
class _Layer:
    """Per packed query token x head, for one layer."""

    foreign: torch.Tensor
    stale: torch.Tensor
    own: torch.Tensor
    cross: torch.Tensor  # mass on other tenants' keys (which heads' rows a recorder keeps, not a finding)
    nonfinite: torch.Tensor  # how many NaN or infinite weights the row holds
    duplicate: torch.Tensor
    source: torch.Tensor  # writer id (provenance interner) of the largest foreign source, 0 = none
    entropy: torch.Tensor  # the seed's positional entropy of the row, in nats


@dataclass
class _Served:
    """What a request's first forward showed: the step, the position it started at, whose K/V stood before it."""

    step: int
    tokens: int
    writer: str | None


@dataclass
class _KeyClasses:
    """Per (query row, key) of one attention group, [R, Q, L]."""

    own: torch.Tensor
    not_own: torch.Tensor
    foreign: torch.Tensor  # written by another prefix; the rest of not_own is stale
    cross: torch.Tensor | None  # own by content but written by another tenant (None: no such key)
    q_pos: torch.Tensor  # [R, Q]
    writers: torch.Tensor  # [R, L] writer id of each key slot
    twins: tuple[torch.Tensor, torch.Tensor] | None  # keys sorted by content and which neighbours hold the same own
    # content, [R, L] and [R, Q, L-1] (None: no row holds one content twice)
    codes: torch.Tensor | None = None  # uint8 0 own / 1 foreign / 2 stale, made on first request
    own_f: torch.Tensor | None = None  # own as float32 1/0, to count a row's visible own keys by a matrix product


@dataclass
class ProvenanceOracle:
    """An AttentionObserver: attach to Engine.run(observers=[...]) with compute="inspect"."""

    config: OracleConfig = field(default_factory=OracleConfig)
    findings: list[Finding] = field(default_factory=list)
    steps: list[StepLeak] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"own": 0, "foreign": 0, "stale": 0})
    open_reads: dict[tuple[str, int, int], Finding] = field(default_factory=dict)  # (reader, block, lifetime)
    served: dict[str, _Served] = field(default_factory=dict)  # request -> its first forward, until its reply is checked

    def begin_step(self, ctx: StepContext) -> None:
        dev = ctx.q_pos.device
        prov = ctx.provenance

        def tensor(a) -> torch.Tensor:  # a view of the provenance array on CPU, a copy elsewhere
            return torch.frombuffer(a, dtype=torch.int64).to(dev)

        self.ctx = ctx
        self.slot_prefix, self.slot_pos = tensor(prov.prefix), tensor(prov.pos)
        self.slot_writer, self.slot_tenant, self.slot_life = tensor(prov.writer), tensor(prov.tenant), tensor(prov.life)
        self.block_life = torch.as_tensor(ctx.block_lifetimes, dtype=torch.long, device=dev)  # an array: read live
        width = max(len(p) for p in ctx.prefix_ids)
        self.req_prefix = torch.tensor([p + [-1] * (width - len(p)) for p in ctx.prefix_ids], device=dev)
        self.req_tenant = torch.tensor([prov.tenants.id(t) for t in ctx.tenants], device=dev)
        self.writer_names = prov.requests.names
        self.layers: dict[int, _Layer] = {}
        self.classes: dict[int, _KeyClasses] = {}
        self.cross_read: dict[int, tuple[AttentionGroup, torch.Tensor]] = {}  # [R, Q, L] keys read, any layer
        self.kernel: dict[int, torch.Tensor] = {}  # layer -> [T, H] a weightless kernel's distance, in tolerances
        self.scratch: dict[torch.dtype, torch.Tensor] = {}  # flat buffers every layer of the step reuses
        for w in ctx.work:
            if w.seq_id not in self.served:  # its first forward (a preempted request's recompute is not)
                first = w.block_table[0] * ctx.block_size if w.start and w.block_table else None
                self.served[w.seq_id] = _Served(ctx.step, w.start,
                                                self.writer_names[prov.writer[first]] if first is not None else None)

    def key_classes(self, group: AttentionGroup) -> torch.Tensor:
        """[R, Q, L] uint8 per (query row, key): 0 own, 1 foreign, 2 stale (for recorders)."""
        k = self._classify(group)
        if k.codes is None:  # the same in every layer of the step
            k.codes = torch.where(k.own, 0, torch.where(k.foreign, 1, 2)).to(torch.uint8)
        return k.codes

    def _classify(self, group: AttentionGroup) -> _KeyClasses:
        """Key classes per (query row, key) of a group: the same in every layer, so computed once."""
        if id(group) in self.classes:
            return self.classes[id(group)]
        R, Q, L = group.mask.shape
        ctx, slots = self.ctx, group.key_slots
        qr, qp = ctx.q_row[group.span].view(R, Q), ctx.q_pos[group.span].view(R, Q)
        kpos = self.slot_pos[slots]  # [R, L]
        written = (self.slot_life[slots] == self.block_life[slots // ctx.block_size]) & (kpos >= 0)
        expected = self.req_prefix[qr[:, :, None], kpos.clamp(0, self.req_prefix.shape[1] - 1)[:, None, :]]
        own = written[:, None] & (kpos[:, None] <= qp[..., None]) & (self.slot_prefix[slots][:, None] == expected)
        cross = own & (self.slot_tenant[slots][:, None] != self.req_tenant[qr][..., None])
        out = self.classes[id(group)] = _KeyClasses(own, ~own, written[:, None].expand_as(own) & ~own,
                                                     cross if bool(cross.any()) else None, qp, self.slot_writer[slots],
                                                     _twins(self.slot_prefix[slots], written, own))
        return out

    def on_attention(self, layer: int, group: AttentionGroup, probs: torch.Tensor) -> None:
        """Per query row and head: mass on own / foreign / stale / other-tenant keys, and the source.
        Clean rows cost four passes over the probabilities (row sum, non-own mass, own count, entropy)."""
        R, H, Q, L = probs.shape
        k = self._classify(group)
        total = probs.sum(-1)  # NaN or inf anywhere in the row shows here
        finite = torch.isfinite(total)
        zero = torch.zeros(R, H, Q, device=probs.device)
        if bool(finite.all()):
            p, nonfinite = probs, zero.long()
        else:
            bad = ~torch.isfinite(probs)
            p, nonfinite = torch.where(bad, 0.0, probs), bad.sum(-1)
        # the [R, H, Q, L] products go to a buffer every layer reuses: a fresh one of that size each time
        # costs more in page faults than the arithmetic; the values, and so the sums, are the same
        leak = torch.mul(p, k.not_own[:, None], out=self._scratch(p.shape, p.dtype, p.device)).sum(-1)
        foreign_m, stale_m, source = zero, zero, zero.long()
        if bool((leak > 0).any()):
            foreign_w = p * k.foreign[:, None]
            foreign_m, stale_m = foreign_w.sum(-1), leak - foreign_w.sum(-1)
            source = self._top_writer(foreign_w, k.writers)
            self.counts["foreign"] += int((foreign_w > 0).sum())
            self.counts["stale"] += int(((p > 0) & (k.not_own & ~k.foreign)[:, None]).sum())
        # how many own keys each row weighs: a product of 1/0 floats, exact as counts below 2**24 are
        if k.own_f is None:
            k.own_f = k.own.float()
        positive = torch.gt(p, 0, out=self._scratch(p.shape, torch.float32, p.device))
        own_visible = torch.einsum("rhql,rql->rhq", positive, k.own_f).long()
        # one content read twice: more own keys than positions, or a twin filling the hole of a missing position
        twice = own_visible > k.q_pos[:, None] + 1
        if k.twins is not None:  # two keys of one content, both weighed
            order, same = k.twins
            weighed = positive.gather(-1, order[:, None, None, :].expand_as(positive))
            twice |= (weighed[..., 1:] * weighed[..., :-1] * same[:, None]).sum(-1) > 0
        self.counts["own"] += int(own_visible.sum())
        cross_m = zero
        if k.cross is not None:
            cross_w = p * k.cross[:, None]
            cross_m, read = cross_w.sum(-1), (cross_w > 0).any(1)
            before = self.cross_read.get(id(group))
            self.cross_read[id(group)] = (group, read if before is None else before[1] | read)

        def per_token(x: torch.Tensor) -> torch.Tensor:  # [R, H, Q] -> [R*Q, H] in packed order
            return x.permute(0, 2, 1).reshape(R * Q, H)

        entropy = torch.special.entr(p, out=self._scratch(p.shape, p.dtype, p.device)).sum(-1)
        rows = _Layer(per_token(foreign_m), per_token(stale_m), per_token(torch.where(finite, total, 0) - leak),
                      per_token(cross_m), per_token(nonfinite), per_token(twice),
                      per_token(source), per_token(entropy))
        self._store(layer, group, rows)

    def _scratch(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of this shape, over memory kept for the rest of the step (grown when a group needs more)."""
        n, buf = shape.numel(), self.scratch.get(dtype)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = self.scratch[dtype] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)

    def on_kernel_check(self, layer: int, group: AttentionGroup, excess: torch.Tensor) -> None:
        """excess [R, H, Q]: how far a kernel that returns no weights is from the output of the weights
        on_attention judged (recomputed for it), in tolerances: above 1 they are not the kernel's."""
        R, H, Q = excess.shape
        if layer not in self.kernel:
            self.kernel[layer] = torch.zeros(len(self.ctx.q_row), H, device=excess.device)
        self.kernel[layer][group.span] = excess.permute(0, 2, 1).reshape(R * Q, H).float()

    def leaked_in(self, layer: int, group: AttentionGroup) -> bool:
        """Whether a query of this group put foreign, stale or cross-tenant mass above the threshold at
        this layer (asked during the step, after this layer was judged): the findings' heads to record."""
        acc = self.layers.get(layer)
        if acc is None:
            return False
        span, limit = group.span, self.config.threshold
        return bool(((acc.foreign[span] + acc.stale[span]) > limit).any() or (acc.cross[span] > limit).any())

    def _top_writer(self, weights: torch.Tensor, writers: torch.Tensor) -> torch.Tensor:
        """The writer holding the most weight in each row: [R, H, Q, L] -> [R, H, Q] writer ids."""
        R, H, Q, L = weights.shape
        per_writer = torch.zeros(R, H, Q, len(self.writer_names), device=weights.device)
        per_writer.scatter_add_(-1, writers[:, None, None, :].expand(R, H, Q, L), weights)
        return per_writer.argmax(-1)

    def _store(self, layer: int, group: AttentionGroup, rows: _Layer) -> None:
        T, H = len(self.ctx.q_row), rows.foreign.shape[1]
        if layer not in self.layers:
            self.layers[layer] = _Layer(*(torch.zeros(T, H, dtype=getattr(rows, n).dtype, device=rows.foreign.device)
                                          for n in _Layer.__dataclass_fields__))
        acc = self.layers[layer]
        for name in acc.__dataclass_fields__:
            getattr(acc, name)[group.span] = getattr(rows, name)

    def end_step(self) -> None:
        ctx, cfg = self.ctx, self.config
        order = sorted(self.layers)
        stack = {n: torch.stack([getattr(self.layers[i], n) for i in order]) for n in _Layer.__dataclass_fields__}
        leak = stack["foreign"] + stack["stale"]  # [layers, T, H]
        R, per_query = len(ctx.work), leak.permute(1, 0, 2)  # [T, layers, H]
        zeros = torch.zeros(R, *per_query.shape[1:], device=leak.device)
        idx = ctx.q_row[:, None, None].expand_as(per_query)
        names = [w.seq_id for w in ctx.work]
        self.steps.append(StepLeak(
            ctx.step, names,
            zeros.scatter_reduce(0, idx, per_query, "amax").cpu(),
            zeros.index_add(0, ctx.q_row, per_query).cpu(),
            zeros.index_add(0, ctx.q_row, (per_query > cfg.threshold).to(zeros.dtype)).cpu(),
            zeros.index_add(0, ctx.q_row, stack["entropy"].permute(1, 0, 2)).cpu(),
            torch.bincount(ctx.q_row, minlength=R).tolist()))
        unexplained = torch.where(leak > cfg.threshold, 0.0, (1 - stack["own"]).abs())
        checks = [  # kind, value per row, limit above which it is a finding, source of the value
            ("foreign", stack["foreign"], cfg.threshold, stack["source"]),
            ("stale", stack["stale"], cfg.threshold, None),
            ("normalisation", unexplained, cfg.norm_tolerance, None),
            ("non_finite", stack["nonfinite"].float(), 0.5, None),
            ("duplicate", stack["duplicate"].float(), 0.5, None),
        ]
        if self.kernel:
            checks.append(("kernel_mismatch", torch.stack([self.kernel[i] for i in order]), 1.0, None))
        for kind, values, limit, source in checks:
            self._findings(kind, values, limit, source, order, names)
        self._block_reads()
        del self.layers, self.classes, self.cross_read, self.kernel, self.scratch

    def _block_reads(self) -> None:
        """Extend the cross-tenant reads the previous step had open and this one continued; open a
        finding for each new (reader, block, lifetime); a read not continued this step is closed."""
        ctx, now = self.ctx, {}
        for group, read in self.cross_read.values():
            reader, slot, pos = self._reads(group, read)
            block = slot // ctx.block_size
            pair, at = torch.unique(reader * len(self.block_life) + block, return_inverse=True)
            big = torch.iinfo(torch.long).max
            first_pos = torch.full_like(pair, big).scatter_reduce(0, at, pos, "amin")
            first_slot = torch.full_like(pair, big).scatter_reduce(0, at, slot, "amin")
            for p, q, s in zip(pair.tolist(), first_pos.tolist(), first_slot.tolist(), strict=True):
                r, b = divmod(p, len(self.block_life))
                key = (ctx.work[r].seq_id, b, int(self.block_life[b]))
                f = self.open_reads.get(key)
                if f is None:
                    f = Finding("cross_tenant", key[0], ctx.step, None, None, q,
                                self.writer_names[int(self.slot_writer[s])], None, block=b)
                    self.findings.append(f)
                f.last_step = ctx.step
                now[key] = f
        self.open_reads = now

    def _reads(self, group: AttentionGroup, read: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(reader work row, key slot, first query position) of every key read, as flat tensors; a
        row whose queries all belong to one request (paged) is reduced over its queries first."""
        R, Q, L = read.shape
        qr, qp = self.ctx.q_row[group.span].view(R, Q), self.ctx.q_pos[group.span].view(R, Q)
        if bool((qr == qr[:, :1]).all()):
            big = torch.iinfo(torch.long).max
            first = torch.where(read, qp[..., None], big).amin(1)  # [R, L]
            r, k = (first < big).nonzero(as_tuple=True)
            return qr[r, 0], group.key_slots[r, k], first[r, k]
        r, q, k = read.nonzero(as_tuple=True)
        return qr[r, q], group.key_slots[r, k], qp[r, q]

    def take_findings(self, final: bool = False) -> list[Finding]:
        """Remove and return the findings that can no longer change: all but the cross-tenant reads
        still open (their last_step may grow), or every one when final (a server that runs for days
        records findings as it goes)."""
        keep = set() if final else {id(f) for f in self.open_reads.values()}
        taken = [f for f in self.findings if id(f) not in keep]
        self.findings = [f for f in self.findings if id(f) in keep]
        if final:
            self.open_reads = {}
        return taken

    def _findings(self, kind, values, limit, source, layers, names) -> None:
        """One finding per (request, source) for each kind: its worst (layer, head, query)."""
        worst: dict[tuple, tuple] = {}
        for li, t, h in (values > limit).nonzero().tolist():
            src = self.writer_names[int(source[li, t, h])] if source is not None else None
            key, v = (names[int(self.ctx.q_row[t])], src), float(values[li, t, h])
            if key not in worst or v > worst[key][0]:
                worst[key] = (v, layers[li], h, int(self.ctx.q_pos[t]))
        for (req, src), (v, layer, head, pos) in worst.items():
            self.findings.append(Finding(kind, req, self.ctx.step, layer, head, pos, src, round(v, 6)))

    def check_telemetry(self, request: str, reported_cached: int) -> Finding | None:
        """Compare the cached tokens a request's reply reported (negative: it reports none) with the tokens
        its first forward showed it was served; a mismatch is a finding, on every run. Asked once the request
        has ended (its first forward is forgotten then)."""
        seen = self.served.pop(request, None)
        if seen is None or reported_cached < 0 or reported_cached == seen.tokens:
            return None
        f = Finding("telemetry_mismatch", request, seen.step, None, None, seen.tokens, seen.writer,
                    float(reported_cached))
        self.findings.append(f)
        return f

    def mean_entropy(self) -> dict[str, float]:
        """Each request's positional entropy (nats), the mean over its queries, layers and heads."""
        total: dict[str, float] = {}
        count: dict[str, int] = {}
        for s in self.steps:
            _, layers, heads = s.sum_entropy.shape
            for r, name in enumerate(s.requests):
                total[name] = total.get(name, 0.0) + float(s.sum_entropy[r].sum())
                count[name] = count.get(name, 0) + s.rows[r] * layers * heads
        return {name: round(total[name] / count[name], 6) for name in total if count[name]}

    def summary(self) -> dict:
        """Run-level leak figures with the keys scripts gate on."""
        total_rows = sum(sum(s.rows) * s.max_foreign.shape[1] * s.max_foreign.shape[2] for s in self.steps)
        leaky = sum(float(s.leak_rows.sum()) for s in self.steps)
        summed = sum(float(s.sum_foreign.sum()) for s in self.steps)
        worst = max((float(s.max_foreign.max()) for s in self.steps), default=0.0)
        return {
            "max_foreign_mass": round(worst, 6),
            "mean_foreign_mass": round(summed / total_rows, 8) if total_rows else 0.0,
            "leak_rate": round(leaky / total_rows, 6) if total_rows else 0.0,
            "counts": dict(self.counts),
        }


def _twins(prefix: torch.Tensor, written: torch.Tensor, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Keys sorted by content (prefix id: the tokens up to a key, so its position too) and, per query, which
    neighbours in that order are two own keys of one content; None when no row holds a content twice."""
    unwritten = -1 - torch.arange(prefix.shape[1], device=prefix.device)  # distinct, below every prefix id
    ordered, order = torch.where(written, prefix, unwritten).sort(-1)
    same = ordered[:, 1:] == ordered[:, :-1]  # [R, L-1]
    if not bool(same.any()):
        return None
    own_sorted = own.gather(-1, order[:, None, :].expand_as(own))
    return order, (same[:, None] & own_sorted[..., 1:] & own_sorted[..., :-1]).float()
