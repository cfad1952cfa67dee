"""vLLM and SGLang KV-cache event batches (msgpack), in every encoding either has used.

A batch is `[ts, events, rank]` (vLLM's data_parallel_rank, SGLang's attn_dp_rank; older SGLang sent
`[ts, events]`; a map is accepted too). An event is a map tagged by "type" (vLLM 0.26 and later,
recent SGLang) or a positional array whose first item is the type (earlier releases, fields only
ever appended). SGLang differs in a few fields: its salt is `cache_salt` (a map key, or in the
positional form a trailing `{"cache_salt": ...}` map where vLLM has lora_name), and with bigram
keys (EAGLE) each token is a pair `[token, next token]`. Hashes are unsigned 64-bit ints (vLLM;
values above 2^63 occur), signed ints (SGLang, very old vLLM), or 32-byte digests; all become the
low 64 bits as an unsigned int.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from ..errors import CaptureError

_M64 = (1 << 64) - 1
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


@dataclass(frozen=True)
class KVEvent:
    seq: int  # the message's sequence number
    ts: float
    rank: int | None
    kind: str  # BlockStored | BlockRemoved | AllBlocksCleared
    block_hashes: tuple[int, ...] = ()
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    salts: tuple[str | None, ...] = ()  # per block: the tenant salt found in extra_keys, if any


def to_u64(h: object, where: str) -> int:
    if isinstance(h, bool):
        raise CaptureError(f"{where}: a hash cannot be a boolean")
    if isinstance(h, int):
        return h & _M64  # old releases published signed ints
    if isinstance(h, bytes | bytearray) and len(h) >= 8:
        return int.from_bytes(bytes(h[-8:]), "big")
    raise CaptureError(f"{where}: a block hash must be an int or at least 8 bytes, got {type(h).__name__}")


def decode_batch(payload: bytes, seq: int) -> list[KVEvent]:
    where = f"message seq {seq}"
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
    if not isinstance(ts, int | float):
        raise CaptureError(f"{where}: ts must be a number")
    return [_event(e, seq, float(ts), rank, f"{where} event {i}") for i, e in enumerate(batch[1])]


def _event(e: object, seq: int, ts: float, rank, where: str) -> KVEvent:
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
        return KVEvent(seq, ts, rank, kind)
    hashes = e.get("block_hashes")
    if not isinstance(hashes, list):
        raise CaptureError(f"{where}: block_hashes must be a list")
    hashes = tuple(to_u64(h, where) for h in hashes)
    if kind == "BlockRemoved":
        return KVEvent(seq, ts, rank, kind, hashes, medium=e.get("medium"))
    if kind != "BlockStored":
        raise CaptureError(f"{where}: unknown event type {kind!r}")
    tokens, size = e.get("token_ids"), e.get("block_size")
    if isinstance(tokens, list):  # SGLang bigram pages: the token at each position is the first of its pair
        tokens = [t[0] if isinstance(t, list) and len(t) == 2 and isinstance(t[0], int) else t for t in tokens]
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise CaptureError(f"{where}: token_ids must be a list of ints (or SGLang [token, next] pairs)")
    if not isinstance(size, int) or size < 1 or len(tokens) != size * len(hashes):
        raise CaptureError(f"{where}: token_ids must hold block_size x {len(hashes)} tokens")
    parent = e.get("parent_block_hash")
    cache_salt, extra = e.get("cache_salt"), e.get("extra_keys") or [None] * len(hashes)
    if isinstance(cache_salt, str):  # SGLang names the salt of every block in the event
        salts = (cache_salt,) * len(hashes)
    else:  # vLLM puts it among a block's extra keys
        salts = tuple(_salt(x) for x in extra) if isinstance(extra, list) else (None,) * len(hashes)
    return KVEvent(seq, ts, rank, kind, hashes, None if parent is None else to_u64(parent, where), tuple(tokens),
                   size, e.get("lora_name"), e.get("medium"), salts)


def _salt(keys: object) -> str | None:
    """The first string among a block's extra keys: the cache salt (or LoRA name) that namespaces it."""
    if isinstance(keys, str):
        return keys
    if isinstance(keys, list | tuple):
        return next((k for k in keys if isinstance(k, str)), None)
    return None
