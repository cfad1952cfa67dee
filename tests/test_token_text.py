"""Token labels: the text, or the bytes of a partial character in hex."""

from __future__ import annotations

from kvviz.models.tiny import byte_tokenizer
from kvviz.store.token_text import token_label


def test_a_token_holding_part_of_a_character_is_labelled_by_its_bytes():
    """The byte-level tokenizer splits 红 (E7 BA A2) into three tokens: each is labelled by its byte,
    not by the vocabulary's stand-in characters; whole text stays as it is."""
    tok = byte_tokenizer()
    ids = tok.encode("红 a\n", add_special_tokens=False)
    assert [token_label(tok, i) for i in ids] == ["<E7>", "<BA>", "<A2>", " ", "a", "\n"]
    assert tok.convert_ids_to_tokens(ids[0]) != "<E7>", "the raw piece is the stand-in character"


class _Pieces:
    """A tokenizer whose pieces are given: SentencePiece byte fallback, byte-level spellings, other."""

    def __init__(self, pieces: dict[int, str]):
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "\ufffd"

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.pieces[i]


def test_byte_fallback_and_byte_level_pieces_become_bytes():
    tok = _Pieces({1: "<0xE7>", 2: "çº", 3: "Ġæ", 4: "▁漢"})
    assert [token_label(tok, i) for i in (1, 2, 3)] == ["<E7>", "<E7 BA>", " <E6>"]
    assert token_label(tok, 4) == "▁漢", "a piece that is neither is shown as the vocabulary spells it"
