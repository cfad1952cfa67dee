"""vLLM and SGLang KV-cache event batches (msgpack), in every encoding either has used.

A batch is `[ts, events, rank]` (vLLM's data_parallel_rank, SGLang's attn_dp_rank; older SGLang sent
`[ts, events]`; a map is accepted too). An event is a map tagged by "type" (vLLM 0.26 and later,
recent SGLang) or a positional array whose first item is the type (earlier releases, fields only
ever appended). SGLang differs in a few fields: its salt is `cache_salt` (a map key, or in the
positional form a trailing `{"cache_salt": ...}` map where vLLM has lora_name), and with bigram
keys (EAGLE) each token is a pair `[token, next token]`. Hashes are unsigned 64-bit ints (vLLM;
values above 2^63 occur), signed ints (SGLang, very old vLLM), or 32-byte digests; all become the
low 64 bits as an unsigned int.

Fields a later release adds are ignored here and kept in the raw payload; an event type this
module does not know keeps its name and hashes, so a capture from a newer server still imports.
Token lists are checked for type when they become Arrow columns (rows.py), so decoding a block costs
no Python work per token. A store whose token count disagrees with its blocks times its block size is
decoded as published: it breaks the KV-event contract (capture/lint.py counts it), which is no reason
to refuse the rest of a capture; rows.py gives its blocks no tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack

from ..errors import CaptureError
from . import vllm_layout

_M64 = (1 << 64) - 1
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
KNOWN_KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class KVEvent(NamedTuple):
    """One event, normalised (a tuple: millions are made per import)."""
    kind: str  # BlockStored | BlockRemoved | AllBlocksCleared | a newer type, kept by name
    block_hashes: list[int] = []  # noqa: RUF012 (never mutated)
    parent_hash: int | None = None
    token_ids: list = []  # noqa: RUF012  all blocks' tokens concatenated, unchecked until they become a column
    block_size: int | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    salts: list[str | None] | None = None  # per block: the tenant salt found in extra_keys, if any
    group_idx: int | None = None  # the KV-cache group (hybrid models): the same hash in two groups is two blocks
    spec_kind: str | None = None  # kv_cache_spec_kind, e.g. full_attention, sliding_window
    sliding_window: int | None = None
    locality: str | None = None  # LOCAL | REMOTE
    session_id: str | None = None
    lookahead_token_ids: list | None = None  # tokens past the block that entered its hash


class Batch(NamedTuple):
    ts: float
    rank: int | None
    events: list[KVEvent]


def to_u64(h: object, where: str) -> int:
    if isinstance(h, int) and not isinstance(h, bool):
        return h & _M64  # old releases published signed ints
    if isinstance(h, bytes | bytearray) and len(h) >= 8:
        return int.from_bytes(bytes(h[-8:]), "big")
    if isinstance(h, bool):
        raise CaptureError(f"{where}: a block hash cannot be a boolean")
    raise CaptureError(f"{where}: a block hash must be an int or at least 8 bytes, got {type(h).__name__}")


def decode_batch(payload: bytes, where: str) -> Batch | vllm_layout.Batch:
    """The batch's events: decoded in C when the batch is in vLLM's current layout (almost all are),
    else by `decode_any_layout`, which also says what is wrong."""
    try:
        return vllm_layout.DECODER.decode(payload)
    except vllm_layout.NOT_THIS_LAYOUT:
        return decode_any_layout(payload, where)


def decode_any_layout(payload: bytes, where: str) -> Batch:
    """Every layout vLLM and SGLang have published, in Python; CaptureError names what is wrong."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except msgpack.ExtraData:
        raise CaptureError(f"{where}: not a msgpack event batch (bytes follow the batch)") from None
    except msgpack.StackError:
        raise CaptureError(f"{where}: not a msgpack event batch (nested too deeply)") from None
    except (msgpack.FormatError, ValueError) as e:
        raise CaptureError(f"{where}: not a msgpack event batch ({str(e).rstrip('.')})") from None
    if isinstance(batch, dict):
        batch = [batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank", batch.get("attn_dp_rank"))]
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise CaptureError(f"{where}: a batch is [ts, events, rank]")
    ts, rank = batch[0], batch[2] if len(batch) > 2 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise CaptureError(f"{where}: ts must be a number")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise CaptureError(f"{where}: the rank must be an int or nil")
    try:
        return Batch(float(ts), rank, [_event(e, "") for e in batch[1]])
    except CaptureError as err:  # the event is named only on this path: naming each costs a string per event
        i = next(i for i, e in enumerate(batch[1]) if _fails(e))
        raise CaptureError(f"{where} event {i}{err}") from None


def _fails(e: object) -> bool:
    try:
        _event(e, "")
    except CaptureError:
        return True
    return False


def _event(e: object, where: str) -> KVEvent:
    if isinstance(e, list) and e and isinstance(e[0], str):  # legacy positional encoding
        kind, rest, metadata = e[0], e[1:], {}
        fields = STORED_FIELDS if kind == "BlockStored" else REMOVED_FIELDS
        if kind == "BlockStored" and len(rest) > 6 and isinstance(rest[6], dict):
            rest, metadata = rest[:6], rest[6]  # SGLang: [..., medium, {"cache_salt": ...}], not lora_name
        e = {**metadata, "type": kind, **dict(zip(fields, rest, strict=False))}
    if not isinstance(e, dict) or not isinstance(e.get("type"), str):
        raise CaptureError(f"{where}: an event is a map with a 'type' or an array starting with it")
    kind = e["type"]
    if kind == "AllBlocksCleared":
        return KVEvent(kind)
    hashes = e.get("block_hashes")
    if not isinstance(hashes, list):
        if kind not in KNOWN_KINDS and hashes is None:
            return KVEvent(kind)  # a newer event without blocks: kept by name
        raise CaptureError(f"{where}: block_hashes must be a list")
    hashes = [h & _M64 if h.__class__ is int else to_u64(h, where) for h in hashes]
    medium, group, locality = e.get("medium"), e.get("group_idx"), e.get("locality")
    if medium.__class__ is not str and medium is not None:
        medium = _text(e, "medium", where)
    if group is not None:
        group = _int(e, "group_idx", where)
    if locality is not None:
        locality = _text(e, "locality", where)
    if kind != "BlockStored":  # BlockRemoved, or a newer event about blocks
        return KVEvent(kind, hashes, medium=medium, group_idx=group, locality=locality)
    tokens, size = e.get("token_ids"), e.get("block_size")
    if tokens.__class__ is list and tokens and tokens[0].__class__ is list:  # SGLang bigram pages (EAGLE):
        tokens = [t[0] if isinstance(t, list) and len(t) == 2 else t for t in tokens]  # a position's own token
    if tokens is None:
        tokens = []  # a store without tokens: a breach of the contract, counted, not a decoding error
    if tokens.__class__ is not list:
        raise CaptureError(f"{where}: token_ids must be a list of ints (or SGLang [token, next] pairs)")
    if size.__class__ is not int or not 1 <= size < (1 << 31):
        size = None  # no usable block size: the event's tokens cannot be split into blocks (rows.py keeps none)
    parent = e.get("parent_block_hash")
    cache_salt, extra = e.get("cache_salt"), e.get("extra_keys")
    if cache_salt.__class__ is str:  # SGLang names the salt of every block in the event
        salts = [cache_salt] * len(hashes)
    elif extra.__class__ is list:  # vLLM puts it among a block's extra keys
        salts = [vllm_layout.salt_of(x) for x in extra[:len(hashes)]] + [None] * (len(hashes) - len(extra))
    else:
        salts = None
    lookahead = e.get("lookahead_token_ids")
    if lookahead is not None and not (isinstance(lookahead, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and -(1 << 31) <= t < (1 << 31) for t in lookahead)):
        raise CaptureError(f"{where}: lookahead_token_ids must be a list of ints")
    return KVEvent(kind, hashes, None if parent is None else to_u64(parent, where), tokens, size,
                   _int(e, "lora_id", where), _text(e, "lora_name", where), medium, salts, group,
                   _text(e, "kv_cache_spec_kind", where), _int(e, "kv_cache_spec_sliding_window", where), locality,
                   _text(e, "session_id", where), lookahead)


def _text(e: dict, key: str, where: str) -> str | None:
    v = e.get(key)
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)  # an enum published by value
    raise CaptureError(f"{where}: {key} must be text or nil, got {type(v).__name__}")


def _int(e: dict, key: str, where: str) -> int | None:
    v = e.get(key)
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63)):
        return v
    raise CaptureError(f"{where}: {key} must be an int or nil, got {v!r:.40}")
