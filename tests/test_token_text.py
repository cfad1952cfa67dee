"""Token labels: the text, or the bytes of a partial character in hex."""

from __future__ import annotations

from kvviz.analysis.tokens import label, sequence_labels
from kvviz.models.tiny import byte_tokenizer
from kvviz.store.token_text import label_bytes, token_label


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


def test_a_labels_bytes_are_what_it_stands_for():
    tok = byte_tokenizer()
    ids = tok.encode("红 a", add_special_tokens=False)
    assert b"".join(label_bytes(token_label(tok, i)) for i in ids) == "红 a".encode()
    assert label_bytes("<0xE7>") == b"\xe7" and label_bytes(" <E6>x") == b" \xe6x"
    assert label_bytes("漢") == "漢".encode()


def test_a_character_split_over_tokens_is_named_in_each_piece_never_by_its_bytes():
    """The heatmap's axes showed <E7> <BA> <A2> for 红: each piece now names its character and which piece it is;
    a token that is whole text keeps its label, and a piece with no whole character around it shows as �."""
    tok = byte_tokenizer()
    ids = tok.encode("红 a\n", add_special_tokens=False)
    texts = {i: token_label(tok, i) for i in ids}
    assert sequence_labels(texts, ids) == ["红(1/3)", "红(2/3)", "红(3/3)", "␣", "a", "\\n"]
    assert [label(texts, i) for i in ids[:3]] == ["<E7>", "<BA>", "<A2>"], "alone, a piece is its bytes"
    cut = ids[:2] + ids[3:5]  # 红 without its last byte: two pieces of no whole character, then ' a'
    assert sequence_labels(texts, cut) == ["�(1/2)", "�(2/2)", "␣", "a"]
    assert sequence_labels({}, [5, 6]) == ["#5", "#6"], "a run without token texts labels tokens by id"
    assert not any("<" in lab for lab in sequence_labels(texts, ids + ids[:1]))
