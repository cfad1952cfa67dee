"""A token's label in heatmaps and block maps: its text, or, where it holds only part of a multi-byte
character (byte-level BPE splits 红 into two or three tokens), its bytes in hex, <E7 BA>, instead of
the vocabulary's internal spelling of them ("çº")."""

from __future__ import annotations

import re

from ..util.byte_level import CHAR_TO_BYTE

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's spelling of a raw byte
_ESCAPED = re.compile(r"(?:\\x[0-9a-f]{2})+")  # what a bytes decode with backslashreplace leaves
_ESCAPED_BYTE = re.compile(r"\\x([0-9a-f]{2})")
_HEX = re.compile(r"<0x([0-9A-Fa-f]{2})>|<((?:[0-9A-F]{2} )*[0-9A-F]{2})>")  # what token_label writes for bytes


def token_label(tokenizer, token_id: int) -> str:
    """The token decoded alone; if that is not whole text, its bytes, the incomplete ones in hex."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    piece = str(tokenizer.convert_ids_to_tokens(token_id))
    raw = _piece_bytes(piece)
    if raw is None:
        return piece
    text = raw.decode("utf-8", errors="backslashreplace")
    return _ESCAPED.sub(lambda m: "<" + " ".join(_ESCAPED_BYTE.findall(m.group(0))).upper() + ">", text)


def _piece_bytes(piece: str) -> bytes | None:
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    if piece and all(c in CHAR_TO_BYTE for c in piece):
        return bytes(CHAR_TO_BYTE[c] for c in piece)
    return None


def label_bytes(label: str) -> bytes:
    """The bytes a label of token_label stands for (its text in UTF-8, each <E7 BA> as those bytes): the pieces
    of one character, labelled apart, put together again (analysis.tokens.sequence_labels)."""
    out, end = [], 0
    for m in _HEX.finditer(label):
        out += [label[end:m.start()].encode(), bytes.fromhex(m.group(1) or m.group(2))]
        end = m.end()
    return b"".join([*out, label[end:].encode()])
