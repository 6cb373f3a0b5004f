"""Streaming detokenization of a `tokenizer.json` (`text_tokenizers.QwenTextTokenizer.stream`).

Invariant: whatever the push sizes, the pieces joined (plus `flush`) are the full decode of every id, and no
piece ever holds a broken character: a multi-byte character split over ids is held back until its last byte
id arrives. Special ids are skipped as in `decode`.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_native_prompts import byte_level_tokenizer_json
from oxygen_jax.robots.text_tokenizers import QwenTextTokenizer

TEXT = 'pick the "€5" bowl — ü 你好 ok.'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    pytest.importorskip("tokenizers")
    d = tmp_path_factory.mktemp("tok")
    byte_level_tokenizer_json(d, {"image": 300, "vision_start": 301, "vision_end": 302, "im_start": 303, "im_end": 304})
    return QwenTextTokenizer(d / "tokenizer.json")


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_streamed_pieces_join_to_the_full_decode_and_never_split_a_character(tok, chunk):
    ids = tok.encode(TEXT)
    ids = ids[:5] + [304] + ids[5:]  # a special id inside the answer is skipped, as decode skips it
    assert len(ids) > len(TEXT)  # byte tokens: multi-byte characters span several ids
    stream, pieces = tok.stream(), []
    for i in range(0, len(ids), chunk):
        pieces.append(stream.push(ids[i:i + chunk]))
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids) == stream.text == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_an_unfinished_character_waits_for_its_last_byte_and_flush_gives_what_is_there(tok):
    euro = tok.encode("€")  # three byte ids
    assert len(euro) == 3
    stream = tok.stream()
    assert stream.push(tok.encode("a")) == "a"
    assert stream.push(euro[:1]) == "" and stream.push(euro[1:2]) == ""
    assert stream.push(np.asarray(euro[2:])) == "€"
    assert stream.push(euro[:2]) == ""
    assert stream.flush() == tok.decode(euro[:2])  # the broken tail, once the answer has ended
