"""Tokenizer, prompt formats and streaming detokenization (demo tokenizer, fully offline)."""

import numpy as np
import pytest

from oxygen_jax.robots import tokenizer as tk
from oxygen_jax.robots.tokenizer import (
    StreamDetokenizer, Tokenizer, discretize_state, encode_suffix_prompt, format_text_prompt, tokenize_action_prompt, tokenize_text_prompt, train_demo_tokenizer,
    train_text_tokenizer,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_demo_tokenizer()


# --- model loading and special ids ----------------------------------------------------------------


def test_demo_tokenizer_has_paligemma_special_ids(tok):
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert 300 <= tok.vocab_size <= 400


def test_demo_tokenizer_training_is_deterministic(tok):
    tk._demo_model_proto.cache_clear()
    assert train_demo_tokenizer().to_bytes() == tok.to_bytes()


def test_from_bytes_round_trips_the_serialized_model(tok):
    again = Tokenizer.from_bytes(tok.to_bytes())
    assert again.encode("Task: open the drawer") == tok.encode("Task: open the drawer")


def test_from_file_missing_names_the_path_and_where_to_get_the_real_model(tmp_path):
    missing = tmp_path / "paligemma.model"
    with pytest.raises(FileNotFoundError, match="gs://big_vision/paligemma_tokenizer.model") as e:
        Tokenizer.from_file(missing)
    assert str(missing) in str(e.value)


def test_from_file_rejects_a_file_that_is_not_sentencepiece(tmp_path):
    bad = tmp_path / "tok.model"
    bad.write_bytes(b"definitely not a protobuf")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        Tokenizer.from_file(bad)


def test_from_file_loads_a_written_model(tok, tmp_path):
    path = tmp_path / "demo.model"
    path.write_bytes(tok.to_bytes())
    assert Tokenizer.from_file(path).vocab_size == tok.vocab_size


def test_task_tokenizer_is_deterministic_and_makes_labels_short():
    texts = ["Memory: ", "Scene: ", "put the red block in the basket", "Done: red block in basket.", "Done: nothing."]
    tok = train_text_tokenizer(texts, 300)
    assert tok.to_bytes() == train_text_tokenizer(texts, 300).to_bytes()
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    label = "Done: red block in basket."
    assert tok.decode(tok.encode(label)) == label and len(tok.encode(label)) < len(train_demo_tokenizer().encode(label))
    assert tok.decode(tok.encode("unseen: ünïcode")) == "unseen: ünïcode"  # byte fallback


# --- encode / decode ------------------------------------------------------------------------------


def test_encode_with_bos_prepends_only_bos_and_never_eos(tok):
    plain = tok.encode("pick the cup")
    assert tok.encode("pick the cup", add_bos=True) == [tok.bos_id, *plain]
    assert tok.eos_id not in plain


def test_decode_drops_pad_and_control_ids_without_stopping(tok):
    ids = tok.encode("ab")
    assert tok.decode([tok.bos_id, *ids, tok.pad_id, tok.eos_id, *ids, tok.pad_id]) == "abab"


def test_decode_rejects_ids_outside_the_vocabulary(tok):
    with pytest.raises(ValueError, match="outside the tokenizer vocabulary"):
        tok.decode([5, tok.vocab_size])


def test_non_ascii_text_round_trips_through_byte_fallback(tok):
    text = "héllo wörld € 😀 中文 "
    assert tok.decode(tok.encode(text)) == text


# --- state discretisation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, bin_",
    [(-1.0, 0), (-1.0 + 1 / 128, 1), (0.0, 128), (0.9921875, 255), (1.0, 255), (7.0, 255), (-1.01, -1)],
)
def test_discretize_state_bin_edges(x, bin_):
    assert discretize_state(np.array([x])).tolist() == [bin_]


def test_discretize_state_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        discretize_state(np.array([0.0, np.nan]))


# --- prompt formats -------------------------------------------------------------------------------


def test_pi05_action_prompt_round_trips_with_state_trailing_space_and_newline(tok):
    ids, mask = tokenize_action_prompt(tok, " Pick_up the\ncup ", np.array([-1.0, 0.0, 0.9921875, -1.01]), 64)
    n = int(mask.sum())
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape == (64,)
    assert ids[0] == tok.bos_id and tok.eos_id not in ids[:n]
    # Cleaning keeps case; the state bins are single-space separated; the prompt ends with "Action: ".
    assert tok.decode(ids) == "Task: Pick up the cup, State: 0 128 255 -1;\nAction: "
    assert ids[:n].tolist() == tok.encode("Task: Pick up the cup, State: 0 128 255 -1;\nAction: ", add_bos=True)


def test_pi0_action_prompt_is_bos_task_then_newline_tokens(tok):
    ids, mask = tokenize_action_prompt(tok, "Open_the drawer ", None, 32)
    expected = tok.encode("Open the drawer", add_bos=True) + tok.encode("\n")
    assert ids[: len(expected)].tolist() == expected
    assert mask.tolist() == [True] * len(expected) + [False] * (32 - len(expected))
    assert tok.decode(ids) == "Open the drawer\n"


def test_prompts_are_padded_with_zero_ids_and_false_mask(tok):
    ids, mask = tokenize_action_prompt(tok, "go", None, 16)
    assert (ids[~mask] == 0).all() and mask[0] and not mask[-1]
    assert mask.tolist() == sorted(mask.tolist(), reverse=True)  # one contiguous run of real tokens


def test_truncated_prompt_warns_by_how_much_and_keeps_mask_consistent(tok):
    full = tok.encode(format_text_prompt("put the bowl on the plate"), add_bos=True)
    with pytest.warns(UserWarning, match=f"truncated by {len(full) - 5} tokens"):
        ids, mask = tokenize_text_prompt(tok, "put the bowl on the plate", max_len=5)
    assert ids.tolist() == full[:5] and mask.all()


@pytest.mark.parametrize(
    "task, text",
    [
        ("Pick the red cup!", "Task: pick the red cup. Subtask: "),
        ("  open_the\ndrawer", "Task: open the drawer. Subtask: "),
        ("stack blocks", "Task: stack blocks. Subtask: "),
    ],
)
def test_text_prompt_lower_cases_cleans_and_ends_task_with_one_period(tok, task, text):
    assert format_text_prompt(task) == text
    ids, mask = tokenize_text_prompt(tok, task, max_len=100)
    assert ids[0] == tok.bos_id and ids.shape == (100,)
    assert tok.decode(ids[mask]) == text


def test_suffix_prompt_has_no_bos_and_continues_a_shared_prefix(tok):
    prefix, _ = tokenize_text_prompt(tok, "pick the cup", max_len=64)
    suffix = encode_suffix_prompt(tok, "reach the cup.")
    assert tok.bos_id not in suffix
    assert tok.decode([*prefix.tolist(), *suffix]) == "Task: pick the cup. Subtask: reach the cup."


# --- streaming detokenization ---------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stream_detokenizer_equals_full_decode_including_non_ascii(tok, chunk):
    ids = tok.encode("Subtask: grasp the cup → then lift é, ü, 😀 and 中文 done.")
    stream = StreamDetokenizer(tok)
    pieces = [stream.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids) == stream.text
    assert all("\ufffd" not in p for p in pieces)  # never emits half a character


def test_stream_detokenizer_holds_back_an_incomplete_multibyte_character(tok):
    euro = tok.encode("€")
    assert len(euro) == 3  # three byte-fallback pieces in the demo vocabulary
    stream = StreamDetokenizer(tok)
    assert [stream.push(i) for i in tok.encode("a")] == ["a"]
    assert [stream.push(i) for i in euro] == ["", "", "€"]


def test_stream_detokenizer_flush_returns_an_unfinished_byte_sequence(tok):
    stream = StreamDetokenizer(tok)
    assert stream.push(tok.encode("€")[:2]) == ""
    assert stream.flush() == stream.text == tok.decode(tok.encode("€")[:2])


def test_stream_detokenizer_ignores_pad_ids(tok):
    stream = StreamDetokenizer(tok)
    out = stream.push([*tok.encode("go"), tok.pad_id, tok.pad_id]) + stream.flush()
    assert out == stream.text == "go"
