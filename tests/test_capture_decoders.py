"""The compiled decoder (vllm_layout, the import's fast path) and the general one (events.py) must
read every batch the same way: the same events, or the same refusal. Batches are generated around
vLLM's current layout, with the variations that must leave the fast path (signed or digest hashes,
SGLang's fields, bigram tokens, unknown types, wrong counts, enums published by value)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvviz.capture import vllm_layout
from kvviz.capture.capture_file import CaptureWriter, Message, read_capture
from kvviz.capture.events import KVEvent, decode_any_layout, decode_batch
from kvviz.errors import CaptureError

U64 = st.integers(0, (1 << 64) - 1)
TOKEN = st.integers(0, 50_000)


def _values(clean: bool) -> dict[str, st.SearchStrategy]:
    """Values vLLM publishes (clean), or those mixed with what must leave the fast path."""
    text = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "tenant-a", "full_attention"]))
    integer = st.one_of(st.none(), st.integers(0, 40))
    extra = st.one_of(st.none(), st.lists(st.one_of(st.none(), st.text(max_size=3)), max_size=3))
    hashes, token = U64, TOKEN
    if not clean:
        text = st.one_of(text, st.integers(0, 3))
        integer = st.one_of(integer, st.integers(1 << 62, (1 << 64) - 1), st.booleans())
        extra = st.one_of(extra, st.text(max_size=3), st.lists(st.integers(-5, 5), max_size=2))
        hashes = st.one_of(U64, st.integers(-(1 << 63), -1), st.binary(min_size=8, max_size=32))
        token = st.one_of(TOKEN, st.integers(1 << 31, 1 << 40), st.booleans())
    return {"text": text, "int": integer, "extra": extra, "hash": hashes, "token": token}


@st.composite
def stored(draw: st.DrawFn, clean: bool) -> dict:
    v = _values(clean)
    hashes = draw(st.lists(v["hash"], max_size=4))
    size = draw(st.sampled_from([1, 2, 4] if clean else [1, 4, 0]))
    count = size * len(hashes) + (0 if clean else draw(st.sampled_from([0, 1, -1])))
    tokens = draw(st.lists(v["token"], min_size=max(count, 0), max_size=max(count, 0)) if clean or draw(st.booleans())
                  else st.just([[1, 2]] * max(count, 0)))  # SGLang's bigram pairs
    event: dict = {"type": "BlockStored", "block_hashes": hashes,
                   "parent_block_hash": draw(st.one_of(st.none(), v["hash"])), "token_ids": tokens, "block_size": size}
    for key, values in (("lora_id", v["int"]), ("medium", v["text"]), ("lora_name", v["text"]),
                        ("group_idx", v["int"]), ("kv_cache_spec_kind", v["text"]),
                        ("kv_cache_spec_sliding_window", v["int"]), ("locality", v["text"]),
                        ("session_id", v["text"]), ("cache_salt", v["text"]),
                        ("extra_keys", st.lists(v["extra"], max_size=5)),
                        ("lookahead_token_ids", st.one_of(st.none(), st.lists(v["token"], max_size=3))),
                        ("a_field_from_a_later_release", st.integers(-(1 << 63), (1 << 64) - 1))):
        if draw(st.booleans()):
            event[key] = draw(values)
    return event


@st.composite
def removed(draw: st.DrawFn, clean: bool) -> dict:
    v = _values(clean)
    event = {"type": draw(st.sampled_from(["BlockRemoved"] if clean else ["BlockRemoved", "BlockMoved"])),
             "block_hashes": draw(st.lists(v["hash"], max_size=4))}
    for key, values in (("medium", v["text"]), ("group_idx", v["int"]), ("locality", v["text"])):
        if draw(st.booleans()):
            event[key] = draw(values)
    return event


@st.composite
def batches(draw: st.DrawFn) -> list:
    clean = draw(st.booleans())
    events = st.one_of(stored(clean), removed(clean), st.just({"type": "AllBlocksCleared"}))
    ts = st.one_of(st.floats(0, 2e9), st.integers(0, 2_000_000_000))
    return [draw(ts if clean else st.one_of(ts, st.booleans())), draw(st.lists(events, max_size=4)),
            draw(st.one_of(st.none(), st.integers(0, 7)))]


def _events(batch: object) -> list[tuple]:
    return [tuple(getattr(e, f) for f in KVEvent._fields) for e in batch.events]


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_both_decoders_read_every_batch_the_same(batch: list) -> None:
    payload = msgpack.packb(batch)
    try:
        expected = decode_any_layout(payload, "m")
    except CaptureError as e:
        try:
            decode_batch(payload, "m")
        except CaptureError as again:
            assert str(again) == str(e)
            return
        raise AssertionError(f"the fast path accepted what the general decoder refuses: {e}") from None
    got = decode_batch(payload, "m")
    assert (got.ts, got.rank) == (expected.ts, expected.rank)
    assert _events(got) == _events(expected)


def test_vllm_current_layout_takes_the_compiled_path() -> None:
    """The equality above would hold if the fast path always gave up; this says it does not."""
    event = {"type": "BlockStored", "block_hashes": [(1 << 64) - 1, 7], "parent_block_hash": 3,
             "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [["tenant-a"], None], "group_idx": 0}
    payload = msgpack.packb([1.5, [event, {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"},
                                   {"type": "AllBlocksCleared"}], 0])
    batch = decode_batch(payload, "m")
    assert isinstance(batch, vllm_layout.Batch)
    first = batch.events[0]
    assert (first.kind, first.salts, first.parent_hash, first.block_hashes) == (
        "BlockStored", ["tenant-a", None], 3, [(1 << 64) - 1, 7])
    assert [e.kind for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert _events(batch) == _events(decode_any_layout(payload, "m"))


def test_capture_lines_read_the_same_on_both_paths(tmp_path) -> None:
    """A line msgspec takes and one only JSON takes (a NaN clock) give the same messages; a line that
    is wrong is refused with its number whichever path saw it first."""
    path = tmp_path / "c.jsonl"
    w = CaptureWriter(path, {"pod": "tcp://x:1"})
    w.add(Message("pod", 0, 0, "kv", b"\x93\x01\x90\x00", 1.5))
    w.close()
    with open(path, "a") as f:
        f.write('{"replica": "pod", "seq": 1, "topic": "kv", "payload": "kwGQAA==", "received": NaN}\n')
    (first, a), (second, b) = list(read_capture(path))
    assert (a.replica, a.restart, a.seq, a.topic, a.received) == ("pod", 0, 0, "kv", 1.5)
    assert a.payload == b"\x93\x01\x90\x00"
    assert (b.seq, b.payload) == (1, a.payload) and b.received != b.received  # NaN
    assert (first, second) == (f"{path}: line 2", f"{path}: line 3")
    with open(path, "a") as f:
        f.write('{"replica": "pod", "seq": 2, "payload": "not base64!"}\n')
    try:
        list(read_capture(path))
    except CaptureError as e:
        assert str(e) == f"{path}: line 4: the payload is not base64"
    else:
        raise AssertionError("a line with a bad payload was read")
