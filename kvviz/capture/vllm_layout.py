"""The layout almost every capture is in (vLLM 0.26 and later: `[ts, [events tagged by "type"], rank]`,
unsigned 64-bit hashes, int token ids), decoded and checked in C by msgspec: the import's fast path.

A batch that does not fit exactly, for any reason (another release's layout, SGLang's fields, an
unknown event type, a value out of range, a wrong token count), raises here and is decoded again by
the general decoder in events.py, which accepts the other layouts and names what is wrong. So this
module never decides that input is bad, and both decoders must give the same events (a property
test compares them). Events here carry KVEvent's attribute names, so the row builder takes either.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

Int32 = Annotated[int, msgspec.Meta(ge=-(1 << 31), lt=1 << 31)]
Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
Hash = int  # 0 .. 2^64 - 1: msgspec reads any 64-bit int; a negative one (old releases) falls back


class _NotOnThisEvent:
    """KVEvent's fields that an event type does not carry."""
    parent_hash = block_size = lora_id = lora_name = medium = salts = group_idx = None
    spec_kind = sliding_window = locality = session_id = lookahead_token_ids = None
    block_hashes: ClassVar[list] = []
    token_ids: ClassVar[list] = []


class Stored(msgspec.Struct, _NotOnThisEvent, tag_field="type", tag="BlockStored"):
    kind: ClassVar[str] = "BlockStored"
    block_hashes: list[Hash]
    token_ids: list[Int32]
    block_size: int
    parent_hash: Hash | None = msgspec.field(default=None, name="parent_block_hash")
    lora_id: Int64 | None = None
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list | None = None
    cache_salt: str | None = None
    group_idx: Int64 | None = None
    spec_kind: str | None = msgspec.field(default=None, name="kv_cache_spec_kind")
    sliding_window: Int64 | None = msgspec.field(default=None, name="kv_cache_spec_sliding_window")
    locality: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[Int32] | None = None

    def __post_init__(self) -> None:
        n = len(self.block_hashes)
        if self.block_size < 1 or len(self.token_ids) != self.block_size * n:
            raise ValueError("token count")
        if (n and min(self.block_hashes) < 0) or (self.parent_hash is not None and self.parent_hash < 0):
            raise ValueError("a signed hash")

    @property
    def salts(self) -> list[str | None] | None:
        """Per block, the tenant salt: SGLang's cache_salt, or the first text among vLLM's extra keys."""
        n = len(self.block_hashes)
        if self.cache_salt is not None:
            return [self.cache_salt] * n
        extra = self.extra_keys
        if extra is None:
            return None
        return [None if x is None else salt_of(x) for x in extra[:n]] + [None] * (n - len(extra))


class Removed(msgspec.Struct, _NotOnThisEvent, tag_field="type", tag="BlockRemoved"):
    kind: ClassVar[str] = "BlockRemoved"
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: Int64 | None = None
    locality: str | None = None

    def __post_init__(self) -> None:
        if self.block_hashes and min(self.block_hashes) < 0:
            raise ValueError("a signed hash")


class Cleared(msgspec.Struct, _NotOnThisEvent, tag_field="type", tag="AllBlocksCleared"):
    kind: ClassVar[str] = "AllBlocksCleared"


class Batch(msgspec.Struct, array_like=True):
    """[ts, events, rank]: the same attributes as events.Batch."""
    ts: float
    events: list[Stored | Removed | Cleared]
    rank: Int64 | None = None


def salt_of(keys: object) -> str | None:
    """The first string among a block's extra keys: the cache salt (or LoRA name) that namespaces it."""
    if isinstance(keys, str):
        return keys
    if isinstance(keys, list | tuple):
        return next((k for k in keys if isinstance(k, str)), None)
    return None


DECODER = msgspec.msgpack.Decoder(Batch)
NOT_THIS_LAYOUT = msgspec.MsgspecError
