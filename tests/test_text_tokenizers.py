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


# ------------------------------------------------------------------------------------------------------------
# Tokenizer files are read before they are trusted (issue 42, item 4)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"\x00garbage{", b"{}", b'{"model": 5}'], ids=["garbage", "empty-object", "bad-model"])
def test_a_malformed_tokenizer_json_is_one_value_error_naming_the_file(tmp_path, content):
    pytest.importorskip("tokenizers")
    from oxygen_jax.robots.text_tokenizers import load_tokenizer

    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError) as e:
        load_tokenizer(tmp_path / "tokenizer.json")
    assert str(tmp_path / "tokenizer.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model"])
def test_a_link_to_a_device_is_refused_unread_and_not_taken_for_an_absent_file(tmp_path, name):
    from oxygen_jax.robots.native_prompts import find_beside
    from oxygen_jax.robots.text_tokenizers import load_tokenizer

    (tmp_path / name).symlink_to("/dev/urandom")
    assert find_beside(name, tmp_path / "checkpoint") == tmp_path / name  # found, so its reader refuses it
    with pytest.raises(ValueError, match="not a regular file"):
        load_tokenizer(tmp_path / name)
    (tmp_path / name).unlink()
    (tmp_path / name).symlink_to(tmp_path / "missing")
    with pytest.raises((FileNotFoundError, ValueError), match="cannot be read|no such"):
        load_tokenizer(tmp_path / name)


def test_the_largest_id_is_checked_against_the_models_vocabulary_not_the_entry_count(tok, tmp_path):
    import json

    from oxygen_jax.robots.text_tokenizers import check_vocabulary, load_tokenizer, max_token_id
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer

    spec = json.loads(tok.path.read_text())
    spec["model"]["vocab"]["far"] = 1_000_245  # one entry, numbered far past the others
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    sparse = load_tokenizer(tmp_path / "tokenizer.json")
    assert sparse.vocab_size < 512 and max_token_id(sparse) == 1_000_245 and max_token_id(tok) == 304
    with pytest.raises(ValueError, match="produces ids up to 1000245 but the model's vocabulary has 512 rows"):
        check_vocabulary(sparse, 512, tmp_path / "tokenizer.json")
    check_vocabulary(tok, 305, tok.path)
    demo = train_demo_tokenizer()
    assert max_token_id(demo) == demo.vocab_size - 1
