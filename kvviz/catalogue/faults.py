"""The fault catalogue: each fault is one defence replaced by a deliberately broken variant.

A fault never touches the oracle: the engine runs with broken defences, the oracle judges from
provenance, and the detection matrix (`python -m kvviz audit`) checks that each fault is seen by
the oracle that should see it. docs/faults.md explains each one and the real bug it mirrors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from weakref import WeakKeyDictionary

import torch

from ..engine import Defences
from ..engine.defences import NOT_OWNED, grouped_attend, shared_axis_mask
from ..engine.pool_patches import PoolPatches
from ..errors import WorkloadError


@dataclass(frozen=True)
class Scope:
    """Where a fault strikes (None = everywhere). Page-table and mask faults honour steps and
    requests; attention-arithmetic faults honour steps and layers; block-lifecycle faults (CoW,
    release, eviction, hash key) change the pool itself and strike wherever the pool is used."""

    steps: frozenset[int] | None = None
    requests: frozenset[str] | None = None
    layers: frozenset[int] | None = None
    every: int | None = None  # strike on steps divisible by this (the intermittent positional leak)

    def hits(self, step: int, request: str | None = None, layer: int | None = None) -> bool:
        return ((self.steps is None or step in self.steps) and (self.every is None or step % self.every == 0)
                and (self.requests is None or request is None or request in self.requests)
                and (self.layers is None or layer is None or layer in self.layers))

    def to_dict(self) -> dict:
        return {k: sorted(v) if isinstance(v, frozenset) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict) -> Scope:
        return cls(**{k: frozenset(v) if isinstance(v, list) else v for k, v in d.items()})

    @classmethod
    def parse(cls, steps: str | None = None, requests: str | None = None, layers: str | None = None,
              names: tuple[str, str] = ("fault steps", "fault layers")) -> Scope | None:
        """From comma-separated lists as typed on the command line or in the UI (`names` say where, for
        errors); None when all are empty."""
        if not (steps or requests or layers):
            return None
        return cls(steps=int_set(steps, names[0]), requests=name_set(requests), layers=int_set(layers, names[1]))

    @property
    def everywhere(self) -> bool:
        return self.steps is None and self.requests is None and self.layers is None and self.every is None


def _scoped(correct: Defences, faulty: Defences, scope: Scope) -> Defences:
    """Faulty mask and attention functions confined to the scope; the correct ones elsewhere."""
    if scope.everywhere:
        return faulty
    now = {"step": -1, "rows": []}

    def begin_step(step, seq_ids):
        now.update(step=step, rows=seq_ids)

    def mask_fn(owner_pos, q_row, q_pos):
        struck = torch.tensor([scope.hits(now["step"], r) for r in now["rows"]], device=q_row.device)[q_row]
        return torch.where(struck[:, None], faulty.shared_axis_mask(owner_pos, q_row, q_pos),
                           correct.shared_axis_mask(owner_pos, q_row, q_pos))

    def attend(q, k, v, mask, scale, layer=None):
        fn = faulty.attend if scope.hits(now["step"], layer=layer) else correct.attend
        return fn(q, k, v, mask, scale, layer)

    return replace(faulty, begin_step=begin_step, shared_axis_mask=mask_fn, attend=attend)


def int_set(text: str | None, what: str) -> frozenset[int] | None:
    """A comma-separated list of integers >= 0 (None when empty); a WorkloadError names `what` otherwise."""
    if not text or not text.strip():
        return None
    try:
        values = frozenset(int(x) for x in text.split(",") if x.strip())
        if any(v < 0 for v in values):  # steps and layers count from 0
            raise ValueError
    except ValueError:
        raise WorkloadError(f"{what} takes integers >= 0 separated by commas, got {text!r}") from None
    return values


def name_set(text: str | None) -> frozenset[str] | None:
    names = frozenset(x.strip() for x in text.split(",") if x.strip()) if text else frozenset()
    return names or None


@dataclass(frozen=True)
class Fault:
    name: str
    defence: str  # the defence it replaces
    breaks: str  # what goes wrong, in a sentence
    mirrors: str  # the public bug it reproduces
    expected: tuple[str, ...]  # finding kinds the provenance oracle must raise (any of them)
    isolation: str | None  # the mechanism it needs ("masked", "paged") or None for both
    apply: Callable[[Defences, Scope, int], Defences] = field(repr=False)  # (defences, scope, block_size)
    default_scope: Scope = Scope()


# -- page tables and slot mapping --------------------------------------------------------------
def _zero_block_table(d: Defences, scope: Scope, block_size: int) -> Defences:
    def read_table(step, seq_ids, tables):
        return [[0] * len(t) if scope.hits(step, s) else t for s, t in zip(seq_ids, tables, strict=True)]
    return replace(d, read_table=read_table)


def _positional(d: Defences, scope: Scope, block_size: int) -> Defences:
    """On struck steps, the first block after the prefix a request shares with the previous request
    in the batch resolves to that request's block (a prefix-sharing boundary off by one)."""
    def read_table(step, seq_ids, tables):
        out = [list(t) for t in tables]
        for r in range(1, len(out)):
            prev, mine = tables[r - 1], tables[r]
            k = next((i for i, (a, b) in enumerate(zip(prev, mine, strict=False)) if a != b), None)
            if k is not None and scope.hits(step, seq_ids[r]):
                out[r][k] = prev[k]
        return out
    return replace(d, read_table=read_table)


def _wrong_slot_mapping(d: Defences, scope: Scope, block_size: int) -> Defences:
    """Writes assume a request's new slots are contiguous from its first slot of the step."""
    def slot_mapping(tables, q_row, q_pos, block_size):
        first = torch.full((tables.shape[0],), 1 << 62, dtype=torch.long, device=q_pos.device)
        first = first.scatter_reduce(0, q_row, q_pos, "amin")
        base = tables.gather(1, (first // block_size)[:, None])[:, 0] * block_size + first % block_size
        return base[q_row] + q_pos - first[q_row]
    return replace(d, slot_mapping=slot_mapping)


# -- masks (the shared-key-axis mechanism) -----------------------------------------------------
def _owned(owner_pos: torch.Tensor) -> torch.Tensor:
    return owner_pos < NOT_OWNED


def _boundary(d: Defences, scope: Scope, block_size: int) -> Defences:
    """Each request's last query also sees the first slot of the block physically after its last block."""
    def mask_fn(owner_pos, q_row, q_pos):
        mask = shared_axis_mask(owner_pos, q_row, q_pos)
        R, S = owner_pos.shape
        blocks = _owned(owner_pos).view(R, S // block_size, block_size).any(-1)  # [R, blocks on the axis]
        last_block = torch.where(blocks, torch.arange(S // block_size, device=blocks.device), -1).amax(-1)
        nxt = (last_block + 1) * block_size  # axis index of the next block's first slot
        last_query = torch.zeros_like(q_pos, dtype=torch.bool)
        for r in range(R):
            rows = (q_row == r).nonzero()[:, 0]
            last_query[rows[q_pos[rows].argmax()]] = True
        for t in last_query.nonzero()[:, 0].tolist():
            a = int(nxt[q_row[t]])
            if a < S and not bool(_owned(owner_pos[q_row[t], a:a + 1]).any()):
                mask[t, a] = True
        return mask
    return replace(d, shared_axis_mask=mask_fn)


def _global(d: Defences, scope: Scope, block_size: int) -> Defences:
    """The isolation mask is gone: a query sees every slot any other request has written."""
    def mask_fn(owner_pos, q_row, q_pos):
        others = _owned(owner_pos).any(0)[None, :] & ~_owned(owner_pos)[q_row]
        return shared_axis_mask(owner_pos, q_row, q_pos) | others
    return replace(d, shared_axis_mask=mask_fn)


def _padding_as_isolation(d: Defences, scope: Scope, block_size: int) -> Defences:
    """Only padding is masked: a query sees every written slot up to its own place on the axis."""
    def mask_fn(owner_pos, q_row, q_pos):
        own_place = (owner_pos[q_row] == q_pos[:, None]).int().argmax(-1)  # [T] axis index of the query
        axis = torch.arange(owner_pos.shape[1], device=owner_pos.device)
        return _owned(owner_pos).any(0)[None, :] & (axis[None, :] <= own_place[:, None])
    return replace(d, shared_axis_mask=mask_fn)


def _additive_mask_sum(d: Defences, scope: Scope, block_size: int) -> Defences:
    """Isolation and causal planes summed as 0/1 instead of combined with AND: 1 + 0 still passes."""
    def mask_fn(owner_pos, q_row, q_pos):
        same_request = _owned(owner_pos)[q_row].int()
        causal = (owner_pos.amin(0)[None, :] <= q_pos[:, None]).int()  # by position, any request
        return (same_request + causal) > 0
    return replace(d, shared_axis_mask=mask_fn)


# -- the attention arithmetic ------------------------------------------------------------------
def _softmax_then_mask(d: Defences, scope: Scope, block_size: int) -> Defences:
    def probs(logits, m):
        return torch.softmax(logits, -1) * m
    return replace(d, attend=lambda q, k, v, mask, scale, layer=None: grouped_attend(q, k, v, mask, scale, probs))


def _low_precision_fill(d: Defences, scope: Scope, block_size: int) -> Defences:
    """float16 logits large enough (scaled x10^4, as a model with huge attention logits) that the
    finite fill -1e4 no longer hides masked keys; fully masked rows become uniform, not zero."""
    def probs(logits, m):
        return torch.softmax((logits * 1e4).half() + (~m).half() * -1e4, -1).float()
    return replace(d, attend=lambda q, k, v, mask, scale, layer=None: grouped_attend(q, k, v, mask, scale, probs))


# -- block lifecycle ---------------------------------------------------------------------------
def _pool_patch(**patches: Callable) -> Callable[[Defences, Scope, int], Defences]:
    """A lifecycle fault: the engine methods it replaces, by name (PoolPatches' fields), each given as a
    factory of its replacement for the run's owner of that method."""
    typed = PoolPatches(**patches)  # a name that is no field fails here, as FAULTS is built at import

    def apply(d: Defences, scope: Scope, block_size: int) -> Defences:
        return replace(d, pool_patches=typed)
    return apply


def _missing_cow(kv):
    return lambda seq, index: []  # the writer writes into the block it shares


def _early_free(pool):
    def release(blocks, request, kind="free"):
        freed = []
        for b in blocks:
            if b.ref_cnt == 0:
                continue  # already freed early
            b.ref_cnt = 0  # drops every holder's reference, not just this request's
            freed.append(b)
            pool.event(kind, b, request)
        pool.requeue(freed)
    return release


def _stale_hash(pool):
    def evict(b, request):
        old, b.hash = b.hash, None  # the hash -> block entry is left behind: a later lookup hits new content
        pool.event("evict", b, request, hash=old)
    return evict


def _unsalted_prefix(kv):
    keys = kv.hash_keys
    return lambda seq: tuple(k for k in keys(seq) if k[0] != "salt")


def _offload_wrong_block(host):
    address = host.address
    return lambda h: (address(h) + 1) % host.num_blocks  # the neighbouring host block


def _offload_stale_restore(host):
    forget = host.forget

    def keep_key(b, request):
        old = host.keys[b]
        forget(b, request)
        host.cached[old] = b  # the entry survives while the host block takes other content
    return keep_key


def _transfer_wrong_request(kv):
    copy_in, previous = kv.copy_in, []

    def copy_previous(source, blocks, n, seq_id):
        sent = previous[:] or source  # the buffer still holds the previous request's prefill
        previous[:] = source
        return copy_in(sent, blocks, n, seq_id)
    return copy_previous


def _transfer_failed_silently(kv):
    return lambda source, blocks, n, seq_id: "ok"  # nothing arrived; the status says it did


def _untagged_namespace(kv):
    keys = kv.hash_keys
    return lambda seq: tuple(name for _, name in keys(seq))  # "foo" the salt == "foo" the adapter


def _stale_hash_after_truncate(kv):
    def resume(seq_id, hashes, keep):
        kv.seqs[seq_id].block_hashes = list(hashes)  # every old hash kept, also past the truncation
    return resume


def _partial_hash_promoted(kv):
    def resume(seq_id, hashes, keep):
        # the block cut by the truncation keeps its old hash: once it fills with new tokens, that hash
        # (of the old tokens) names it
        kv.seqs[seq_id].block_hashes = list(hashes[:-(-keep // kv.block_size)])
    return resume


# -- the bug classes of 2026 ------------------------------------------------------------------
def _host_key_by_tokens(host):
    return lambda block: block.content  # tokens (and weights) alone: the salt stays on the device tier


def _hash_before_write(kv):
    commit = kv.commit

    def commit_and_publish_ahead(seq_id, num_tokens, slots=None):
        commit(seq_id, num_tokens, slots)
        seq, B = kv.seqs[seq_id], kv.block_size
        # every block it holds whose tokens are all known gets its hash now, written or not
        kv.publish(seq, seq.num_computed // B, min(len(seq.block_table), len(seq.token_ids) // B))
    return commit_and_publish_ahead


@dataclass
class _LateCopies:
    """One host tier's offload copies held back: queued this step, due at the next (after this step's forward)."""

    copy_out: Callable  # the tier's own copy
    queued: list[tuple[int, int]] = field(default_factory=list)
    due: list[tuple[int, int]] = field(default_factory=list)


_LATE: WeakKeyDictionary = WeakKeyDictionary()  # host tier -> _LateCopies (copy_out is patched before pop_transfers)


def _copy_out_later(host):
    late = _LATE[host] = _LateCopies(host.copy_out)
    return lambda device_block, host_block: late.queued.append((device_block, host_block))


def _pop_after_the_forward(host):
    late, pop = _LATE[host], host.pop_transfers

    def pop_late():
        for device_block, host_block in late.due:  # the block's next owner has written it by now
            late.copy_out(device_block, host_block)
        late.due, late.queued = late.queued, []
        return pop()
    return pop_late


def _plain_key(kv):
    keys = kv.hash_keys
    return lambda seq: tuple(k for k in keys(seq) if k[0] != "adapter")  # inserted as if base-model K/V


def _adapters_skip_lookup(kv):
    reads = kv.reads_cache
    return lambda seq: reads(seq) and seq.adapter is None


def _block_boundary(d: Defences, scope: Scope, block_size: int) -> Defences:
    """A prefill that starts on a block boundary after earlier positions (a prefix hit that ends on it)
    writes its first token at slot 0 of the block before: the last block of what it shares."""
    def slot_mapping(tables, q_row, q_pos, block_size):
        slots = d.slot_mapping(tables, q_row, q_pos, block_size)
        first = torch.ones_like(q_row, dtype=torch.bool)
        first[1:] = q_row[1:] != q_row[:-1]
        rows = torch.bincount(q_row, minlength=tables.shape[0])[q_row]
        struck = first & (q_pos % block_size == 0) & (q_pos > 0) & (rows > 1)
        before = tables[q_row].gather(1, (q_pos // block_size - 1).clamp(min=0)[:, None])[:, 0] * block_size
        return torch.where(struck, before, slots)
    return replace(d, slot_mapping=slot_mapping)


def _device_hits_only(kv):
    return lambda device_blocks, restored_blocks: device_blocks * kv.block_size  # restores served, not counted


FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("boundary", "shared-axis mask",
          "a request's last query also sees the first slot of the physically next request",
          "the seed's boundary leak: 红橙黄 | 绿青蓝 with A's 黄 attending 绿", ("foreign",), "masked", _boundary),
    Fault("global", "shared-axis mask", "the isolation mask is dropped: every query sees every live slot",
          "the seed's global leak (mask lost entirely)", ("foreign",), "masked", _global),
    Fault("positional", "page-table lookup",
          "on every other step, the first block after a shared prefix resolves to the previous request's",
          "the seed's positional leak: a prefix-sharing boundary bug, intermittent", ("foreign",), None,
          _positional, Scope(every=2)),
    Fault("padding_as_isolation", "shared-axis mask", "only padding is masked, not other requests",
          "packed-sequence contamination: transformers #46634, torchtune #875, axolotl #3796", ("foreign",),
          "masked", _padding_as_isolation),
    Fault("softmax_then_mask", "attention arithmetic",
          "the mask is applied after softmax: kept weights no longer sum to 1", "timm #2236",
          ("normalisation",), None, _softmax_then_mask),
    Fault("additive_mask_sum", "shared-axis mask", "0/1 isolation and causal planes summed: OR instead of AND",
          "NeMo #2658, transformers #26421", ("foreign",), "masked", _additive_mask_sum),
    Fault("low_precision_fill", "attention arithmetic",
          "float16 logits with a finite -1e4 fill: large logits see through it, empty rows go uniform",
          "transformers #17306; PyTorch #41508, #103749; the seed's 0.3% fp16 leak",
          ("foreign", "stale", "non_finite"), None,
          _low_precision_fill),
    Fault("zero_block_table", "page-table lookup", "attention reads through a page table of zeros (block 0)",
          "vLLM #7018", ("foreign", "stale", "normalisation"), None, _zero_block_table),
    Fault("missing_cow", "copy-on-write", "a fork writes into the partial block it shares with its parent",
          "no CoW for shared partial blocks (what HF's continuous batching copies for)", ("foreign",), None,
          _pool_patch(copy_on_write=_missing_cow)),
    Fault("early_free", "refcount release", "a shared block is freed when its first holder finishes",
          "mini-sglang #142 (use after free), #52 (lock off by one), vLLM #42571", ("foreign", "stale"), None,
          _pool_patch(release=_early_free)),
    Fault("stale_hash", "eviction", "an evicted block's hash entry survives: later lookups hit new content",
          "vLLM #4761", ("foreign",), None, _pool_patch(evict=_stale_hash)),
    Fault("unsalted_prefix", "prefix-cache hash key", "the tenant salt is left out: tenants share prefix blocks",
          "CVE-2025-46570, vLLM RFC #16016 (timing side channel)", ("cross_tenant",), None,
          _pool_patch(hash_keys=_unsalted_prefix)),
    Fault("offload_wrong_block", "offload restore",
          "a restore from the host tier copies the neighbouring host block instead of the one hashed",
          "TensorRT-LLM PR #8830 (offloaded blocks restored with another block's state)", ("foreign", "stale"), None,
          _pool_patch(address=_offload_wrong_block)),
    Fault("offload_stale_restore", "host-tier eviction",
          "a host block taken for other content keeps its old hash: a later hit restores the new content",
          "TensorRT-LLM #8813 (other prompts' tokens in outputs); vLLM #4761 on the host tier", ("foreign",), None,
          _pool_patch(forget=_offload_stale_restore)),
    Fault("transfer_wrong_request", "KV transfer",
          "the decode instance receives the previous request's prefill instead of this one's",
          "vLLM #52234 (the previous prompt's answer)", ("foreign", "stale"), None,
          _pool_patch(copy_in=_transfer_wrong_request)),
    Fault("transfer_failed_silently", "KV transfer",
          "a failed transfer reports success: the decode blocks stay unwritten and decoding goes on",
          "vLLM #52234 (HTTP 200 with garbage after a failed transfer)", ("stale",), None,
          _pool_patch(copy_in=_transfer_failed_silently)),
    Fault("untagged_namespace", "prefix-cache hash key",
          "namespaces enter the hash untagged: a salt and an adapter of the same name share blocks",
          "vLLM #51899 (a LoRA named like a cache_salt)", ("foreign",), None,
          _pool_patch(hash_keys=_untagged_namespace)),
    Fault("stale_hash_after_truncate", "session resume",
          "a session resubmitted with a shorter history keeps every old block hash: new tokens map to old KV",
          "vLLM #49449, #49377", ("foreign",), None, _pool_patch(resume=_stale_hash_after_truncate)),
    Fault("partial_hash_promoted", "session resume",
          "the block a truncation cuts keeps the hash of its old full content, reused once it fills again",
          "vLLM #49125", ("foreign",), None, _pool_patch(resume=_partial_hash_promoted)),
    Fault("wrong_slot_mapping", "slot mapping", "writes assume a request's new slots are contiguous",
          "TGI #2711", ("foreign", "stale"), None, _wrong_slot_mapping),
    Fault("host_tier_unsalted", "host-tier key",
          "the device cache is salted but the host tier keys blocks by tokens alone: a tenant restores another's",
          "SGLang #37160, LMCache #4825 (external storage keys are token-only: cache_salt dropped)",
          ("cross_tenant",), None, _pool_patch(key=_host_key_by_tokens)),
    Fault("hash_before_write", "prefix-cache publish",
          "a block's hash is registered for the tokens it will hold before they are written; a request cancelled "
          "or preempted first leaves a hit on slots nobody wrote",
          "vLLM PR #43569 (eager registration rolled back on an uncommitted free), PR #41400",
          ("stale", "foreign"), None, _pool_patch(commit=_hash_before_write)),
    Fault("offload_after_free", "offload copy",
          "the copy to the host tier runs a step late, after the block's next owner wrote into it: the mixed "
          "content is restored later as a hit",
          "DingoCache PR #76 (a preempted request's in-flight save), LMCache PR #5248, vLLM #45704",
          ("foreign", "stale", "duplicate"), None,
          _pool_patch(copy_out=_copy_out_later, pop_transfers=_pop_after_the_forward)),
    Fault("wrong_key_insert", "prefix-cache insert key",
          "a request whose K/V come from other inputs (an adapter here) skips the lookup but inserts its blocks "
          "under the plain token key: the next plain request hits them",
          "SGLang #27472 (K/V from overridden embeddings inserted under token ids); sglang-omni #258",
          ("foreign",), None, _pool_patch(hash_keys=_plain_key, reads_cache=_adapters_skip_lookup)),
    Fault("block_boundary", "slot mapping at a block boundary",
          "after a shared prefix that ends on a block boundary, the first new token is written into the last "
          "shared block",
          "page-boundary off-by-ones: SGLang PR #10637 (a key cut to whole pages), MinivLLM PR #87 (a full last "
          "block read as empty)", ("foreign", "stale"), None, _block_boundary),
    Fault("uncounted_restore", "usage telemetry",
          "blocks restored from the host tier are served but not counted: the reply says fewer cached tokens "
          "(zero) than the request was served",
          "production-stack #818 (hit tokens read 0 while lookups hit); a hit rate that silently reads 0%",
          ("telemetry_mismatch",), None, _pool_patch(count_cached=_device_hits_only)),
]}


class UnknownFault(WorkloadError):
    pass


def defences_with(name: str | None, block_size: int, scope: Scope | None = None) -> Defences:
    """The defences for a run: the correct ones, or with the named fault injected."""
    if name is None:
        return Defences()
    if name not in FAULTS:
        raise UnknownFault(f"unknown fault {name!r}; the catalogue: {', '.join(FAULTS)}")
    fault, scope = FAULTS[name], scope or FAULTS[name].default_scope
    return _scoped(Defences(), fault.apply(Defences(), scope, block_size), scope)
