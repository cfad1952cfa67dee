"""Byte-level BPE (GPT-2, Llama 3, SmolLM) spells each byte as one printable character: the printable
Latin-1 bytes as themselves, every other byte as a character from U+0100 up, in byte order. A character of
several bytes (红 is E7 BA A2) may so lie across several tokens: whole_characters finds them."""

from __future__ import annotations

from collections.abc import Callable

_KEPT = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
_MOVED = [b for b in range(256) if b not in _KEPT]
BYTE_TO_CHAR = {b: chr(b if b in _KEPT else 256 + _MOVED.index(b)) for b in range(256)}
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def whole_characters(pieces: int, decode: Callable[[int, int], str], most: int = 4) -> list[tuple[int, int, str]]:
    """(a, b, text): runs of tokens a..b-1, in position order, that decode to whole text, each with its text. A
    token holding part of a character decodes alone to U+FFFD; a run ends where its text is whole, at `most`
    tokens (a UTF-8 character has at most 4 bytes) or at the end, and before a token that is whole text alone
    (it continues no character): a broken piece is a run of its own, not dropped, and swallows no neighbour.
    decode(a, b): the text of tokens a..b-1."""
    runs, a, text = [], 0, ""
    for b in range(1, pieces + 1):
        if b - 1 > a and "\ufffd" not in decode(b - 1, b):
            runs.append((a, b - 1, text))
            a = b - 1
        text = decode(a, b)
        if "\ufffd" not in text or b - a >= most or b == pieces:
            runs.append((a, b, text))
            a = b
    return runs
