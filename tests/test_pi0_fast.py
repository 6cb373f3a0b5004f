"""π0-FAST: openpi's tokenization, the FAST codec, the model against openpi's own outputs, and its decoding.

The fixture (`openpi_tiny_pi0_fast`, made by openpi's unmodified code) pins tokenization, teacher-forced logits,
the loss and greedy decoding (all cameras, and a masked camera with openpi's decode window); the codec is checked
at other dimensions than the fixture's (horizon, action dim, FAST vocabulary, scale) with a processor written
here; the decode pool, given `pi0_fast.prefix`, decodes openpi's tokens on a random model of other dims.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxygen_jax.ckpts.load import load_model
from oxygen_jax.ckpts.openpi import load_openpi_params
from oxygen_jax.ckpts.openpi_fast import is_fast_checkpoint, load_fast_codec, load_openpi_fast, load_openpi_fast_params
from oxygen_jax.models import backbone
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.pi05 import pi0_fast, pi0_fast_decode
from oxygen_jax.models.pi05.config import fast_config
from oxygen_jax.models.pi05.params import abstract_params, init_params, to_openpi_dict
from oxygen_jax.robots import fast_prompt, transforms
from oxygen_jax.robots.config import robot_config
from oxygen_jax.robots.fast import FastDecodeError, dct, dct_matrix, idct
from oxygen_jax.robots.io import OPENPI_FAST_CAMERAS, FastPreprocess, RobotIO, observation_rows
from oxygen_jax.robots.tokenizer import Tokenizer, train_demo_tokenizer
from oxygen_jax.runtime import decode as pool_decode
from tests.helpers import fixture, make_obs

FAST = "openpi_tiny_pi0_fast"


# ------------------------------------------------------------------------------------------------
# The codec at other dimensions, with a processor folder written here


def _write_processor(folder, *, horizon=6, action_dim=3, scale=20, min_token=-60, vocab=200, seed=0, **extra):
    """A FAST processor folder like openpi's: a byte-level BPE fitted on quantised DCT chunks + its config."""
    from tokenizers import Tokenizer as BpeTokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, horizon)[:, None]
    chunks = [np.sin(2 * np.pi * (t * rng.uniform(0.2, 1.5, action_dim) + rng.uniform(0, 1, action_dim))) * 0.8
              for _ in range(64)]
    texts = ["".join(map(chr, np.maximum(np.around(dct(c) * scale).astype(int).reshape(-1) - min_token, 0)))
             for c in chunks]
    texts.append("".join(map(chr, range(2 * -min_token))))  # every character a chunk may hold is in the alphabet
    bpe = BpeTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    bpe.save(str(folder / "tokenizer.json"))
    config = dict(scale=scale, vocab_size=vocab, min_token=min_token, time_horizon=horizon, action_dim=action_dim)
    (folder / "processor_config.json").write_text(json.dumps({**config, **extra}))
    return chunks


def test_dct_is_orthonormal_and_equals_its_cosine_sum():
    x = np.random.default_rng(1).standard_normal((7, 4))
    n = x.shape[0]
    naive = np.array([[sum(x[t, a] * np.cos(np.pi * (2 * t + 1) * k / (2 * n)) for t in range(n))
                       * np.sqrt((1 if k else 0.5) * 2 / n) for a in range(4)] for k in range(n)])
    np.testing.assert_allclose(dct(x), naive, atol=1e-12)
    np.testing.assert_allclose(dct_matrix(n) @ dct_matrix(n).T, np.eye(n), atol=1e-12)
    np.testing.assert_allclose(idct(dct(x)), x, atol=1e-12)


def test_codec_round_trip_at_other_dims(tmp_path):
    chunks = _write_processor(tmp_path / "fast")
    codec = load_fast_codec(tmp_path / "fast")
    assert (codec.horizon, codec.action_dim, codec.vocab_size, codec.scale, codec.min_token) == (6, 3, 200, 20.0, -60)
    assert sum(len(codec.encode(x)) for x in chunks[:8]) < 8 * 18  # the BPE merges: fewer tokens than coefficients
    for x in chunks[:8] + [np.random.default_rng(2).uniform(-1, 1, (6, 3))]:
        ids = codec.encode(x)
        assert all(0 <= i < 200 for i in ids)
        quantised = idct(np.around(dct(x) * 20) / 20)
        np.testing.assert_allclose(codec.decode(ids), quantised, atol=1e-12)
        assert np.abs(codec.decode(ids) - x).max() <= 0.5 * np.sqrt(18) / 20  # the rounding, through an isometry


def test_undecodable_fast_tokens_are_reported_never_silent_zeros(tmp_path):
    chunks = _write_processor(tmp_path / "fast", time_horizon=None)  # the chunk shape left to the caller
    codec = load_fast_codec(tmp_path / "fast")
    ids = codec.encode(chunks[0])
    with pytest.raises(ValueError, match="names no time_horizon"):
        codec.decode(ids)
    for bad, why in ((ids[:-1], "coefficients, not horizon x action_dim = 18"), (ids + [200], "outside the FAST vocabulary"),
                     (ids + ids, "coefficients, not horizon x action_dim = 18")):
        with pytest.raises(FastDecodeError, match=why):
            codec.decode(bad, 6, 3)
        assert not np.any(codec.decode(bad, 6, 3, on_failure="zeros"))  # openpi's fallback, by name only
    with pytest.raises(ValueError, match="outside what this FAST tokenizer spells"):
        codec.encode(np.full((6, 3), 50.0))  # coefficients past the fitted alphabet would vanish in the BPE


def test_processor_files_are_checked_before_use(tmp_path):
    _write_processor(tmp_path / "big", time_horizon=10**9)
    with pytest.raises(ValueError, match="time_horizon 1000000000 is above the cap"):
        load_fast_codec(tmp_path / "big")
    _write_processor(tmp_path / "small", vocab=200, vocab_size=100)
    with pytest.raises(ValueError, match="has 200 tokens, more than the processor's vocab_size 100"):
        load_fast_codec(tmp_path / "small")
    _write_processor(tmp_path / "garbled")
    (tmp_path / "garbled" / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match=r"garbled/tokenizer.json: not a readable tokenizer"):
        load_fast_codec(tmp_path / "garbled")
    _write_processor(tmp_path / "noscale")
    config = json.loads((tmp_path / "noscale" / "processor_config.json").read_text())
    (tmp_path / "noscale" / "processor_config.json").write_text(json.dumps({**config, "scale": "10"}))
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        load_fast_codec(tmp_path / "noscale")


# ------------------------------------------------------------------------------------------------
# openpi's tokenization and extract_actions on the fixture (and at other dims with its tokenizer)


@pytest.fixture(scope="module")
def fast_fixture():
    root = fixture(FAST)
    ref = dict(np.load(root / "reference.npz"))
    config = json.loads((root / "config.json").read_text())
    tok = Tokenizer.from_file(root / "paligemma_tokenizer.model")
    return root, ref, config, tok, load_fast_codec(root / "fast_tokenizer")


def test_tokenize_and_extract_actions_as_openpi(fast_fixture):
    _, ref, config, tok, codec = fast_fixture
    prompts, t = config["strings"]["prompts"], ref["tok/train/tokens"].shape[1]
    for text, actions in (("train", ref["actions"]), ("infer", None)):
        ours = fast_prompt.tokenize_batch(tok, prompts, ref["state"], t, codec=codec, actions=actions)
        for value, field in zip(ours, ("tokens", "mask", "ar_mask", "loss_mask")):
            np.testing.assert_array_equal(value, ref[f"tok/{text}/{field}"], err_msg=f"tok/{text}/{field}")
    h, a = ref["actions"].shape[1:]
    for name, ids, want in zip(config["strings"]["extract_cases/names"], ref["extract_cases/tokens"],
                               ref["extract_cases/actions"]):
        if name.startswith("works"):
            np.testing.assert_allclose(fast_prompt.extract_actions(tok, codec, ids, h, a), want, atol=1e-5)
            continue
        with pytest.raises(FastDecodeError):  # openpi returns zeros here, silently
            fast_prompt.extract_actions(tok, codec, ids, h, a)
        np.testing.assert_array_equal(fast_prompt.extract_actions(tok, codec, ids, h, a, on_failure="zeros"), want)


def test_a_training_row_reads_back_as_its_chunk_at_other_dims(fast_fixture, tmp_path):
    """The fixture's PaliGemma tokenizer with a FAST codec of other dims (horizon 6, 3 dims, 200 FAST ids)."""
    _, _, _, tok, _ = fast_fixture
    chunks = _write_processor(tmp_path / "fast")
    codec = load_fast_codec(tmp_path / "fast")
    row = fast_prompt.tokenize(tok, "Open_the DRAWER", np.array([0.2, -0.4]), 64, codec=codec, actions=chunks[3])
    assert tok.decode(row.tokens[row.mask & (row.ar == 0)]) == "Task: open the drawer, State: 153 76;\n"
    decoded = np.where(row.ar == 1, row.tokens, 0)  # what a model emits: the postfix, 0 elsewhere
    np.testing.assert_allclose(fast_prompt.extract_actions(tok, codec, decoded), idct(np.around(dct(chunks[3]) * 20) / 20),
                               atol=1e-6)
    postfix = row.tokens[row.ar == 1]
    with pytest.raises(FastDecodeError, match="coefficients, not horizon x action_dim = 18"):
        fast_prompt.extract_actions(tok, codec, np.concatenate([postfix[:5], postfix[-2:]]))
    with pytest.raises(FastDecodeError, match="not a FAST token"):
        fast_prompt.extract_actions(tok, codec, np.concatenate([postfix[:4], tok.encode("cube"), postfix[4:]]))


# ------------------------------------------------------------------------------------------------
# Robot rows: openpi's π0-FAST camera inputs; LeRobot's π0-FAST folders refused


def test_fast_rows_feed_the_padding_camera_black_and_unmasked_in_openpis_order():
    """openpi's DroidInputs / LiberoInputs for PI0_FAST: DROID base, zeros, wrist; LIBERO base, wrist, zeros; every
    mask True. The rows `observation_rows` makes with π0-FAST's RobotIO equal ones built by hand from that rule
    (28 px, no statistics); π0.5's rows keep the real slots only."""
    tok, rng, px = train_demo_tokenizer(), np.random.default_rng(0), 28
    io = RobotIO(preprocess=FastPreprocess(), cameras=OPENPI_FAST_CAMERAS)
    image = lambda: rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)  # noqa: E731 - not square: padded
    pixels = lambda im: transforms.to_model_pixels(transforms.resize_with_pad(im, px, px))  # noqa: E731
    base, wrist, state = image(), image(), rng.uniform(-1, 1, 8)
    droid = {"observation/exterior_image_1_left": base, "observation/wrist_image_left": wrist,
             "observation/joint_position": state[:7], "observation/gripper_position": state[7:], "prompt": "Pick_up"}
    libero = {"observation/image": base, "observation/wrist_image": wrist, "observation/state": state, "prompt": "Pick_up"}
    for name, sample, order in (("droid", droid, (base, None, wrist)), ("libero", libero, (base, wrist, None))):
        robot = robot_config(name, max_token_len=64)
        obs, _ = observation_rows(io, robot, px, tok.vocab_size, tok, [sample])
        want = np.stack([np.full((px, px, 3), -1.0, np.float32) if im is None else pixels(im) for im in order])
        np.testing.assert_array_equal(obs.images[0], want, err_msg=name)
        assert obs.image_masks.tolist() == [[True] * 3], name
        row = fast_prompt.tokenize(tok, "Pick_up", state.astype(np.float32), 64)
        np.testing.assert_array_equal(obs.tokens[0], row.tokens)
        np.testing.assert_array_equal(obs.token_mask[0], row.mask)
        pi05, _ = observation_rows(RobotIO(), robot, px, tok.vocab_size, tok, [sample])
        np.testing.assert_array_equal(pi05.images[0], want[[0, 2 if name == "droid" else 1]])  # padding dropped
    with pytest.raises(ValueError, match="reads slots .*right_wrist_0_rgb.* that robot 'droid' does not fill"):
        transforms.CameraLayout(("base_0_rgb", "right_wrist_0_rgb")).check(robot_config("droid"))


@pytest.mark.parametrize("kind", ["pi0fast", "pi0_fast"])
def test_a_lerobot_pi0_fast_folder_is_refused_naming_openpis_checkpoint(tmp_path, kind):
    folder = tmp_path / "pretrained_model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"type": kind, "chunk_size": 10}))
    with pytest.raises(ValueError, match=f"type '{kind}' is LeRobot's π0-FAST policy.*use openpi's π0-FAST checkpoint"):
        load_model(tmp_path)


# ------------------------------------------------------------------------------------------------
# The model against openpi's outputs


def _observation(ref, text: str, masked: bool):
    cams = fast_prompt.CAMERAS
    masks = np.stack([ref[f"image_mask/{c}"] if masked else np.ones(2, bool) for c in cams], 1)
    return Observation(images=jnp.stack([jnp.asarray(ref[f"image/{c}"]) for c in cams], 1),
                                image_masks=jnp.asarray(masks), tokens=jnp.asarray(ref[f"tok/{text}/tokens"]),
                                token_mask=jnp.asarray(ref[f"tok/{text}/mask"]))


def test_both_layouts_restore_the_same_pi0_fast_and_the_pi_readers_point_to_each_other(fast_fixture, tmp_path):
    root = fast_fixture[0]
    ck = load_openpi_fast(root)
    assert ck.codec is not None and (ck.codec.horizon, ck.codec.action_dim) == fast_fixture[1]["actions"].shape[1:]
    _, train = load_openpi_fast_params(root / "train_checkpoint" / "1")
    flat, other = to_openpi_dict(ck.params), to_openpi_dict(train)
    assert len(flat) == 32 and all(np.array_equal(flat[k], other[k]) for k in flat)
    assert is_fast_checkpoint(root) and not is_fast_checkpoint(fixture("openpi_tiny_pi05"))
    with pytest.raises(ValueError, match="is a π0-FAST model .*openpi_fast.load_openpi_fast"):
        load_openpi_params(root)
    with pytest.raises(ValueError, match="is not a π0-FAST model .*load_openpi_params"):
        load_openpi_fast_params(fixture("openpi_tiny_pi05", "params"))
    full = abstract_params(fast_config("pi0_fast"))  # no allocation; PaliGemma 3B (gemma_2b + So400m/14) as published
    assert sum(x.size for x in jax.tree.leaves(full)) == 2_923_335_408


@pytest.fixture(scope="module")
def fast_params(fast_fixture):
    return load_openpi_fast_params(fast_fixture[0])[1]


def test_teacher_forced_logits_and_loss_match_openpi_beside_a_masked_camera(fast_fixture, fast_params):
    """masked/*: row 0 has every camera, row 1 a masked one (whose tokens still advance the positions)."""
    ref = fast_fixture[1]
    ar, loss_mask = jnp.asarray(ref["tok/train/ar_mask"]), jnp.asarray(ref["tok/train/loss_mask"])
    obs = _observation(ref, "train", masked=True)
    logits, target = pi0_fast.teacher_forced(fast_params, obs, ar)
    np.testing.assert_allclose(logits, ref["masked/teacher/logits"], atol=5e-4)
    np.testing.assert_allclose(target, ref["masked/teacher/target_logp"], atol=5e-4)
    np.testing.assert_allclose(pi0_fast.compute_loss(fast_params, obs, ar, loss_mask), ref["masked/loss/loss"], atol=5e-4)


def test_greedy_decode_matches_openpi_its_masked_camera_window_and_its_stop_rule(fast_fixture, fast_params):
    """openpi's tokens fed step by step (its own comparison for near ties): every step's logits, its argmax equal
    to openpi's greedy token (the closest call: margin 5.4e-4 at row 1, step 3), positions and the right-aligned
    prefill; the masked camera through openpi's contiguous window; the loop stops after a step of EOS on every row."""
    ref, params = fast_fixture[1], fast_params
    steps, kept = ref["decode/tokens"].shape[1], ref["decode/step_logits"].shape[1]
    for pre, masked in (("decode/", False), ("masked/decode/", True)):
        cache = pi0_fast_decode.prefill(params, _observation(ref, "infer", masked), steps)
        np.testing.assert_array_equal(cache.prefill_len, ref[f"{pre}prefill_len"])
        np.testing.assert_array_equal(cache.positions, ref[f"{pre}prefill_positions"])
        tokens = jnp.asarray(ref[f"{pre}tokens"])
        out = pi0_fast_decode.decode(params, cache, steps, tokens, keep_logits=kept)
        np.testing.assert_allclose(out.logits, ref[f"{pre}step_logits"], atol=5e-4)
        np.testing.assert_array_equal(np.argmax(out.logits, -1), ref[f"{pre}tokens"][:, :kept])
        np.testing.assert_array_equal(out.positions, ref[f"{pre}positions"])
        assert int(out.num_steps) == int(ref[f"{pre}num_steps_run"])
    # EOS on one row (step 2) does not stop the loop; EOS on every row in one step (step 5) does, after that step.
    eos = np.asarray(tokens).copy()
    eos[0, 2], eos[:, 5] = 1, 1
    out = pi0_fast_decode.decode(params, pi0_fast_decode.prefill(params, _observation(ref, "infer", True), steps), steps,
                                 jnp.asarray(eos), keep_logits=kept)
    assert int(out.num_steps) == 6
    np.testing.assert_array_equal(out.tokens, np.where(np.arange(steps) < 6, eos, 0))


# ------------------------------------------------------------------------------------------------
# Decoding invariants on a random model of other dims (GQA, 56 px images, two cameras)


def test_the_decode_pool_on_the_prefix_decodes_what_openpi_decodes():
    config = fast_config("pi0_fast_tiny")
    params = init_params(config, seed=3)
    obs = make_obs(config, batch=2, cameras=2, prompt_len=12, lengths=[10, 6], seed=4)
    steps = 8
    ref = pi0_fast_decode.decode(params, pi0_fast_decode.prefill(params, obs, steps), steps, keep_logits=steps)
    tokens = np.asarray(ref.tokens)
    assert int(ref.num_steps) == steps

    prefix = pi0_fast.prefix(params, obs)
    lm = pi0_fast.language_model(params)
    pool = pool_decode.init_pool(lm, 2, prefix.length, steps)
    req = pool_decode.make_requests(2, 0, [0, 1], rows=[0, 1], budgets=[steps] * 2, stop_ids=[-1] * 2)
    pool, _, _ = pool_decode.admit(lm, pool, prefix, req)
    logits = [backbone.lm_logits(lm.spec, lm.decoder, prefix.last_hidden)]
    for _ in range(steps - 1):
        pool, _, step_logits = pool_decode.decode_step(lm, pool)
        logits.append(step_logits)
    np.testing.assert_array_equal(np.asarray(pool.tokens), tokens)
    # The logits, not only their argmax: positions (openpi's skipped one) and the attended inputs are the same.
    np.testing.assert_allclose(np.stack(logits, 1), ref.logits, atol=1e-4)
