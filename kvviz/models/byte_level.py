"""Byte-level BPE (GPT-2, Llama 3, SmolLM) spells each byte as one printable character: the printable
Latin-1 bytes as themselves, every other byte as a character from U+0100 up, in byte order."""

from __future__ import annotations

_KEPT = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
_MOVED = [b for b in range(256) if b not in _KEPT]
BYTE_TO_CHAR = {b: chr(b if b in _KEPT else 256 + _MOVED.index(b)) for b in range(256)}
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
