"""Prompts as XR0's and StarVLA's processors build them (`robots.native_prompts`).

The specification:

* StarVLA (../shared/fixtures/starvla_*_tiny, made by StarVLA's own `build_qwenvl_inputs`): from each
  row's raw images, state and instruction, with the fixture processor's tokenizer (its word rule and
  special ids as meta.json records them), the token ids and attention mask equal the fixture's exactly
  (left padding included), QwenPI_v3's state text equals what its processor saw, and the pixels, grids
  and M-RoPE ids equal the fixture's;
* a `tokenizer.json` in the checkpoint directory is found and read with the `tokenizers` package, and
  encoding a row piece by piece gives the ids of the whole chat text at once (added tokens split it);
* XR0 (../shared/fixtures/xr0_tiny; its ids are random text around the images, no tokenizer): the image
  blocks (vision start, n image tokens, vision end) per row are the fixture's, and the text is the
  released deploy prompt.

Skipped, naming the fixture, when ../shared is absent.
"""

from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest

from helpers import fixture

from eval.parity import starvla as parity
from oxygen_jax.ckpts import starvla, xr0
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.robots.config import robot_config
from oxygen_jax.robots import native_prompts as npr
from oxygen_jax.robots import transforms

FIXTURES = {"starvla_qwenpi_v3": "starvla_qwenpi_v3_tiny", "starvla_gr00t": "starvla_gr00t_tiny"}


class FixtureWords:
    """The fixtures' processor tokenizer: a word's id is 10 + crc32(word) mod (image id - 10), "\\n" is its own."""

    def __init__(self, token_ids: dict):
        self.ids, self.pad_id = token_ids, token_ids["pad"]

    def encode_text(self, text: str) -> list[int]:
        word = lambda w: 10 + zlib.crc32(w.encode()) % (self.ids["image"] - 10)  # noqa: E731
        return [self.ids["newline"] if w == "\n" else word(w) for w in re.findall(r"\n|\S+", text)]

    def special_id(self, name: str) -> int:
        return self.ids[name]


def _rows_of(ref, instructions, state):
    images = parity.raw_images(ref)
    per_row = len(images) // len(instructions)
    return [{"images": images[r * per_row:(r + 1) * per_row], "instruction": text, "state": state[r]}
            for r, text in enumerate(instructions)]


@pytest.mark.parametrize("family", sorted(FIXTURES))
def test_starvla_rows_equal_the_fixture_processors_ids_pixels_and_positions(family):
    path = fixture(FIXTURES[family])
    ref, meta = dict(np.load(path / "reference.npz")), json.loads((path / "meta.json").read_text())
    seen = meta["injected"]["instructions_seen_by_processor"]
    state = ref["state"].reshape(ref["state"].shape[0], -1)
    instructions = [s.split(" [STATE] ")[0] for s in seen]
    if family == "starvla_qwenpi_v3":
        np.testing.assert_array_equal(npr.state_bins(state), ref["state_bins"])
        assert [npr.starvla_text(t, s) for t, s in zip(instructions, state)] == seen
    else:
        assert instructions == seen  # GR00T's state is a DiT token, not text
    spec = starvla.load(path).spec
    assert npr.family_of(spec) == family
    built = npr.build_rows(family, spec, FixtureWords(meta["injected"]["token_ids"]), _rows_of(ref, instructions, state))
    np.testing.assert_array_equal(built.ids, ref["input_ids"])
    np.testing.assert_array_equal(built.mask, ref["attention_mask"].astype(bool))
    inputs = npr.make_inputs(spec, built)
    np.testing.assert_array_equal(np.asarray(qwen3_vl.as_grid(inputs.grid)), ref["image_grid_thw"])
    np.testing.assert_allclose(np.asarray(inputs.pixel_values), ref["pixel_values"], rtol=0, atol=1e-6)
    real = np.broadcast_to(built.mask, ref["position_ids"].shape)
    np.testing.assert_array_equal(np.asarray(inputs.positions)[real], ref["position_ids"][real])
    # A fixed row length (serving) only adds left padding.
    wide = npr.build_rows(family, spec, FixtureWords(meta["injected"]["token_ids"]),
                          _rows_of(ref, instructions, state), prompt_len=ref["input_ids"].shape[1] + 3)
    np.testing.assert_array_equal(wide.ids[:, 3:], ref["input_ids"])
    assert not wide.mask[:, :3].any()
    with pytest.raises(ValueError, match=r"row 0: the prompt has \d+ tokens but the row holds 5"):
        npr.build_rows(family, spec, FixtureWords(meta["injected"]["token_ids"]), _rows_of(ref, instructions, state),
                       prompt_len=5)


def byte_level_tokenizer_json(directory, token_ids: dict) -> None:
    """A Qwen-style byte-level tokenizer.json (256 byte tokens, no merges) with the model's special ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    special = {npr.SPECIAL_TOKENS[k]: token_ids[k] for k in ("image", "vision_start", "vision_end", "im_start", "im_end")}
    special[npr.SPECIAL_TOKENS["pad"]] = 0
    used = set(special.values())
    free = (i for i in range(1, 10**6) if i not in used)
    vocab = {c: next(free) for c in sorted(pre_tokenizers.ByteLevel.alphabet())} | special
    vocab |= {f"<unused{i}>": i for i in range(max(vocab.values())) if i not in set(vocab.values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(directory / npr.TOKENIZER_FILE))


def _whole_text(row) -> str:
    names = {**npr.SPECIAL_TOKENS}
    return "".join(v if k == "text" else names[v] if k == "special" else names["image"] * v for k, v in row)


def test_a_tokenizer_json_beside_the_checkpoint_encodes_xr0_rows_with_the_fixtures_image_blocks(tmp_path):
    pytest.importorskip("tokenizers")
    path = fixture("xr0_tiny")
    ref = dict(np.load(path / "reference.npz"))
    cfg = xr0.read_config(path)["vlm_config"]
    ids = {"image": cfg["image_token_id"], "vision_start": cfg["vision_start_token_id"],
           "vision_end": cfg["vision_end_token_id"], "im_start": cfg["vision_end_token_id"] + 1,
           "im_end": cfg["vision_end_token_id"] + 2}
    byte_level_tokenizer_json(tmp_path, ids)
    assert npr.find_tokenizer_json(tmp_path / "checkpoint") == tmp_path / npr.TOKENIZER_FILE  # beside it
    tok = npr.QwenTokenizer(npr.find_tokenizer_json(tmp_path))
    assert tok.pad_id == 0 and tok.special_id("image") == ids["image"]

    spec = xr0.model_spec(xr0.read_config(path), {})
    images = [ref[k] for k in sorted(k for k in ref if re.fullmatch(r"image\d+_uint8", k))]
    b = ref["input_ids"].shape[0]
    views = ("base_0_rgb", "left_wrist_0_rgb")
    rows = [{"images": images[r * 2:(r + 1) * 2], "instruction": "put the bowl on the plate", "state": ref["state"][r, 0]}
            for r in range(b)]
    built = npr.build_rows("xr0", spec, tok, rows, views=views)
    for r in range(b):
        row = npr.pieces("xr0", rows[r]["instruction"], [npr.image_token_count(im.shape, spec) for im in rows[r]["images"]],
                         views=views)
        text = _whole_text(row)
        assert text.startswith("<|im_start|>user\nThe following observations are captured from multiple views.\n# Base View\n")
        assert text.endswith("/no_cot<|im_end|>\n<|im_start|>assistant\n<cot></cot><|im_end|>\n")
        assert npr.encode(tok, row) == tok._tok.encode(text, add_special_tokens=False).ids  # piecewise = whole
        vision = {ids["image"], ids["vision_start"], ids["vision_end"]}
        ours = [t for t in built.ids[r][built.mask[r]] if t in vision]
        theirs = [t for t in ref["input_ids"][r][ref["attention_mask"][r] == 1] if t in vision]
        assert ours == theirs, r
    inputs = npr.make_inputs(spec, built)
    np.testing.assert_array_equal(np.asarray(qwen3_vl.as_grid(inputs.grid)), ref["image_grid_thw"])
    np.testing.assert_allclose(np.asarray(inputs.pixel_values), ref["pixel_values"], rtol=0, atol=1e-6)


def test_an_openpi_client_dict_becomes_rows_of_its_cameras_instruction_and_state():
    robot = robot_config("libero")
    samples = [transforms.synthetic_sample(robot, np.random.default_rng(i), prompt=f"task {i}", image_size=80)
               for i in range(2)]
    rows, views = npr.client_rows(robot, samples, image_size=64)
    assert views == tuple(robot.cameras) and [r["instruction"] for r in rows] == ["task 0", "task 1"]
    assert all(im.shape == (64, 64, 3) for r in rows for im in r["images"])
    np.testing.assert_array_equal(rows[1]["state"], transforms.client_state(robot, samples[1]).astype(np.float32))
    with pytest.raises(ValueError, match="QwenPI_v3 writes the state into its prompt"):
        npr.pieces("starvla_qwenpi_v3", "x", [4])
    with pytest.raises(ValueError, match="XR0 names every view: 1 view names for 2 images"):
        npr.pieces("xr0", "x", [4, 4], views=("base_0_rgb",))
