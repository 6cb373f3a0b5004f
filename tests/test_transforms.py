"""Per-robot input/output transforms: client samples → Observation, model actions → robot commands."""

import dataclasses
import math

import numpy as np
import pytest

from oxygen_jax.models.pi05.config import model_config

from oxygen_jax.robots.config import robot_config
from oxygen_jax.robots.normalize import NormStats
from oxygen_jax.models.pi05.observation import validate_observation
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from oxygen_jax.robots.transforms import (
    client_state, make_observation, resize_with_pad, robot_inputs, robot_outputs, synthetic_sample,
)

BASE, LEFT, RIGHT = "base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"


@pytest.fixture(scope="module")
def tok():
    return train_demo_tokenizer()


@pytest.fixture(scope="module")
def tiny():
    return model_config("tiny")  # 56-pixel images


def _const(value, shape=(8, 8, 3)):
    return np.full(shape, value, np.uint8)


def _libero(**overrides):
    s = {
        "observation/image": _const(10),
        "observation/wrist_image": _const(20),
        "observation/state": np.arange(8, dtype=np.float32) / 10,
        "prompt": "put the bowl on the plate",
    }
    s.update(overrides)
    return s


def _droid(**overrides):
    s = {
        "observation/exterior_image_1_left": _const(10),
        "observation/wrist_image_left": _const(20),
        "observation/joint_position": np.arange(7, dtype=np.float32) / 10,
        "observation/gripper_position": np.array([0.5], np.float32),
        "prompt": "open the drawer",
    }
    s.update(overrides)
    return s


def _aloha(cams=("cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist"), **overrides):
    values = {"cam_high": 10, "cam_low": 40, "cam_left_wrist": 20, "cam_right_wrist": 30}
    s = {
        "state": np.linspace(-0.5, 0.5, 14).astype(np.float32),
        "images": {c: _const(values.get(c, 50), (3, 6, 8)) for c in cams},
        "prompt": "uncap the pen",
    }
    s.update(overrides)
    return s


# --- resize_with_pad ------------------------------------------------------------------------------


def test_resize_with_pad_keeps_aspect_ratio_and_centres_with_zero_padding():
    out = resize_with_pad(_const(100, (480, 640, 3)), 224, 224)  # → 168×224 content, 28 pad rows each side
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8
    assert (out[:28] == 0).all() and (out[196:] == 0).all() and (out[28:196] == 100).all()


def test_resize_with_pad_pads_float_images_with_minus_one():
    out = resize_with_pad(np.full((2, 1, 40, 20, 3), 0.5, np.float32), 10, 10)  # → 10×5 content
    assert out.shape == (2, 1, 10, 10, 3) and out.dtype == np.float32
    assert (out[..., :, :2, :] == -1).all() and (out[..., :, 7:, :] == -1).all()
    np.testing.assert_allclose(out[..., :, 2:7, :], 0.5, rtol=1e-6)


def test_resize_with_pad_is_a_copy_when_the_size_already_matches():
    img = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
    out = resize_with_pad(img, 4, 4)
    np.testing.assert_array_equal(out, img)
    assert out is not img


# --- robot_inputs ---------------------------------------------------------------------------------


def test_libero_inputs_map_image_to_base_and_wrist_to_left_wrist_and_drop_the_right_slot():
    out = robot_inputs(robot_config("libero"), _libero())
    assert list(out["images"]) == [BASE, LEFT] and out["image_masks"] == {BASE: True, LEFT: True}
    assert (out["images"][BASE] == 10).all() and (out["images"][LEFT] == 20).all()
    np.testing.assert_allclose(out["state"], np.arange(8) / 10, rtol=1e-6)
    assert out["prompt"] == "put the bowl on the plate"


def test_droid_inputs_concatenate_joints_and_gripper_into_an_eight_dim_state():
    out = robot_inputs(robot_config("droid"), _droid(**{"observation/gripper_position": 0.25}))  # scalar accepted
    assert list(out["images"]) == [BASE, LEFT] and (out["images"][BASE] == 10).all()
    np.testing.assert_allclose(out["state"], [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.25], rtol=1e-6)


def test_aloha_inputs_transpose_chw_images_into_all_three_slots():
    out = robot_inputs(robot_config("aloha"), _aloha())
    assert list(out["images"]) == [BASE, LEFT, RIGHT]
    assert all(img.shape == (6, 8, 3) for img in out["images"].values())
    assert [int(out["images"][s][0, 0, 0]) for s in (BASE, LEFT, RIGHT)] == [10, 20, 30]  # cam_low (40) unused
    assert out["image_masks"] == {BASE: True, LEFT: True, RIGHT: True}


def test_aloha_missing_wrist_camera_is_zeros_with_mask_false():
    out = robot_inputs(robot_config("aloha"), _aloha(cams=("cam_high", "cam_left_wrist")))
    assert out["image_masks"] == {BASE: True, LEFT: True, RIGHT: False}
    assert out["images"][RIGHT].shape == (6, 8, 3) and not out["images"][RIGHT].any()


def test_aloha_prompt_is_optional_when_a_default_is_given():
    sample = _aloha()
    del sample["prompt"]
    assert robot_inputs(robot_config("aloha"), sample, default_prompt="fold")["prompt"] == "fold"


def test_aloha_state_adapt_flips_joints_and_maps_grippers_to_angular():
    state = np.linspace(-0.5, 0.5, 14)
    out = robot_inputs(robot_config("aloha"), _aloha(state=state))["state"]
    flip = np.array([1, -1, -1, 1, 1, 1, 1] * 2)
    joints = [i for i in range(14) if i not in (6, 13)]
    np.testing.assert_allclose(out[joints], (flip * state)[joints], rtol=1e-6)

    def to_angular(v):  # §10, written out with scalars
        lin = v * (0.05800 - 0.01844) + 0.01844
        arg = (0.022**2 + lin**2 - 0.036**2) / (2 * 0.022 * lin)
        return (math.asin(min(1.0, max(-1.0, arg))) - 0.5476) / (1.6296 - 0.5476)

    np.testing.assert_allclose(out[[6, 13]], [to_angular(state[6]), to_angular(state[13])], rtol=1e-5)


def test_aloha_zero_delta_actions_hold_the_current_joint_pose():
    # Input adapt flips joints, output inverse flips them back: a zero delta reproduces the client joints.
    robot = robot_config("aloha")
    state = np.linspace(-0.5, 0.5, 14)
    out = robot_outputs(robot, np.zeros((2, 5, 32)), np.stack([state, 2 * state]))
    assert out.shape == (2, 5, 14) and out.dtype == np.float32
    joints = [i for i in range(14) if i not in (6, 13)]
    np.testing.assert_allclose(out[0, :, joints].T, np.broadcast_to(state[joints], (5, 12)), rtol=1e-6)
    np.testing.assert_allclose(out[1, :, joints].T, np.broadcast_to(2 * state[joints], (5, 12)), rtol=1e-6)


def test_aloha_delta_actions_add_the_state_to_joints_but_not_grippers():
    robot = robot_config("aloha")
    actions = np.random.default_rng(0).normal(size=(4, 32))
    a = robot_outputs(robot, actions, np.zeros(14) + 0.3)
    b = robot_outputs(robot, actions, np.zeros(14) - 0.3)
    np.testing.assert_allclose(a[:, [6, 13]], b[:, [6, 13]])  # grippers are absolute
    flip = np.array([1, -1, -1, 1, 1, 1])
    np.testing.assert_allclose((a - b)[:, :6], np.broadcast_to(0.6, (4, 6)), rtol=1e-5)  # joints: Δstate, flip²=1
    np.testing.assert_allclose(a[:, :6], flip * actions[:, :6] + 0.3, rtol=1e-5)
    np.testing.assert_allclose(a[:, 6], (actions[:, 6] + 0.5476 + 0.6213) / (1.4910 + 0.6213), rtol=1e-5)


def test_aloha_training_actions_round_trip_through_inputs_and_outputs():
    robot = robot_config("aloha")
    rng = np.random.default_rng(1)
    sample = _aloha(state=rng.uniform(0.1, 0.9, 14), actions=rng.uniform(0.1, 0.9, (5, 14)))
    pi_actions = robot_inputs(robot, sample)["actions"]
    padded = np.concatenate([pi_actions, np.zeros((5, 18))], axis=-1)
    out = robot_outputs(robot, padded, client_state(robot, sample))
    np.testing.assert_allclose(out, sample["actions"], atol=1e-5)


# --- robot_outputs --------------------------------------------------------------------------------


def test_libero_outputs_unnormalise_then_keep_the_first_seven_dims():
    stats = {"actions": NormStats.create(mean=np.zeros(7), std=np.ones(7), q01=np.zeros(7), q99=np.full(7, 2.0))}
    out = robot_outputs(robot_config("libero"), np.zeros((10, 32)), None, stats)
    assert out.shape == (10, 7)
    np.testing.assert_allclose(out, 1.0, atol=1e-5)  # normalised 0 is the quantile midpoint


def test_droid_outputs_keep_eight_dims_and_zscore_when_asked():
    stats = {"actions": NormStats.create(mean=np.full(8, 5.0), std=np.full(8, 2.0))}
    out = robot_outputs(robot_config("droid"), np.ones((3, 15, 32)), None, stats, quantile=False)
    assert out.shape == (3, 15, 8)
    np.testing.assert_allclose(out, 7.0, atol=1e-5)


def test_robot_outputs_errors_name_the_problem():
    with pytest.raises(ValueError, match="states_native"):
        robot_outputs(robot_config("aloha"), np.zeros((5, 32)))
    with pytest.raises(ValueError, match="states_native: expected shape \\(2, 14\\)"):
        robot_outputs(robot_config("aloha"), np.zeros((2, 5, 32)), np.zeros(14))
    with pytest.raises(ValueError, match="no 'actions' entry"):
        robot_outputs(robot_config("libero"), np.zeros((5, 32)), None, {"state": NormStats.create([0.0], [1.0])})
    with pytest.raises(ValueError, match=">= 7"):
        robot_outputs(robot_config("libero"), np.zeros((5, 4)))


# --- make_observation -----------------------------------------------------------------------------


@pytest.mark.parametrize("name, sample", [("libero", _libero), ("droid", _droid), ("aloha", _aloha)])
def test_make_observation_batches_real_slots_with_model_pixels(tok, tiny, name, sample):
    robot = robot_config(name)
    obs = make_observation(robot, tiny, tok, [sample(), sample()])
    validate_observation(obs, tiny, robot.num_cameras)
    assert obs.images.shape == (2, robot.num_cameras, 56, 56, 3) and obs.images.dtype == np.float32
    assert obs.tokens.shape == obs.token_mask.shape == (2, 200) and obs.tokens.dtype == np.int32
    assert obs.image_masks.all()
    # Base slot holds uint8 10 (the centre row is content even for ALOHA's letter-boxed 6×8 test images).
    np.testing.assert_allclose(obs.images[:, 0, 28], 10 / 255 * 2 - 1, rtol=1e-6)


def test_make_observation_maps_uint8_extremes_to_minus_one_and_one(tok, tiny):
    sample = _libero(**{"observation/image": _const(0), "observation/wrist_image": _const(255)})
    obs = make_observation(robot_config("libero"), tiny, tok, [sample])
    assert (obs.images[0, 0] == -1).all() and (obs.images[0, 1] == 1).all()


def test_make_observation_pi05_prompt_holds_the_normalised_discretised_state(tok, tiny):
    stats = {"state": NormStats.create(mean=np.zeros(8), std=np.ones(8), q01=np.zeros(8), q99=np.full(8, 2.0))}
    sample = _droid(**{"observation/joint_position": [0, 2, 0, 2, 0, 2, 0], "observation/gripper_position": [2.0]})
    obs = make_observation(robot_config("droid"), tiny, tok, [sample], stats)
    assert tok.decode(obs.tokens[0]) == "Task: open the drawer, State: 0 255 0 255 0 255 0 255;\nAction: "


def test_make_observation_libero_uses_the_pi0_prompt_without_state(tok, tiny):
    obs = make_observation(robot_config("libero"), tiny, tok, [_libero()])
    assert tok.decode(obs.tokens[0]) == "put the bowl on the plate\n"


def test_make_observation_aloha_masks_a_missing_wrist_per_row(tok, tiny):
    obs = make_observation(robot_config("aloha"), tiny, tok, [_aloha(), _aloha(cams=("cam_high", "cam_right_wrist"))])
    assert obs.image_masks.tolist() == [[True, True, True], [True, False, True]]
    assert (obs.images[1, 1] == -1).all()


def test_make_observation_truncates_a_long_prompt_with_a_warning(tok, tiny):
    robot = robot_config("libero", max_token_len=4)
    with pytest.warns(UserWarning, match="truncated by"):
        obs = make_observation(robot, tiny, tok, [_libero()])
    assert obs.token_mask.tolist() == [[True] * 4]


def test_make_observation_missing_prompt_uses_default_or_raises(tok, tiny):
    sample = _libero()
    del sample["prompt"]
    obs = make_observation(robot_config("libero"), tiny, tok, [sample], default_prompt="stack the blocks")
    assert tok.decode(obs.tokens[0]) == "stack the blocks\n"
    with pytest.raises(ValueError, match="missing 'prompt'"):
        make_observation(robot_config("libero"), tiny, tok, [sample])


def _without(sample, key):
    del sample[key]
    return sample


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("libero", lambda: _without(_libero(), "observation/wrist_image"), "missing camera image 'observation/wrist"),
        ("libero", lambda: _libero(**{"observation/image": np.zeros((8, 8), np.uint8)}), "observation/image: expected"),
        ("libero", lambda: _libero(**{"observation/image": np.zeros((8, 8, 4), np.uint8)}), "image.*got shape"),
        ("libero", lambda: _libero(**{"observation/state": np.zeros(7)}), "observation/state: expected .*\\(8,\\)"),
        ("libero", lambda: _libero(**{"observation/state": [0, 0, 0, np.nan, 0, 0, 0, 0]}), "observation/state.*NaN"),
        ("droid", lambda: _without(_droid(), "observation/gripper_position"), "missing 'observation/gripper_position'"),
        ("droid", lambda: _droid(**{"observation/joint_position": "x"}), "observation/joint_position"),
        ("aloha", lambda: _aloha(cams=("cam_left_wrist",)), "missing camera image 'images/cam_high'"),
        ("aloha", lambda: _aloha(cams=("cam_high", "cam_top")), "unknown ALOHA camera names \\['cam_top'\\]"),
        ("aloha", lambda: _aloha(images={"cam_high": _const(1)}), "images/cam_high: expected .*CHW"),
        ("aloha", lambda: _aloha(state=np.zeros(12)), "state: expected .*\\(14,\\)"),
        ("aloha", lambda: _without(_aloha(), "images"), "missing 'images'"),
    ],
)
def test_make_observation_rejects_bad_inputs_naming_the_problem(tok, tiny, name, bad, message):
    with pytest.raises(ValueError, match=message) as e:
        make_observation(robot_config(name), tiny, tok, [_libero() if name == "libero" else bad(), bad()])
    assert str(e.value).startswith("sample 1:" if name == "libero" else "sample 0:")


def test_make_observation_rejects_a_tokenizer_larger_than_the_model_vocabulary(tok, tiny):
    with pytest.raises(ValueError, match="model vocabulary"):
        make_observation(robot_config("libero"), tiny.replace(vocab_size=8), tok, [_libero()])


# --- synthetic samples ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["libero", "droid", "aloha"])
def test_synthetic_sample_is_a_valid_client_sample_with_native_state(name):
    robot = robot_config(name)
    sample = synthetic_sample(robot, np.random.default_rng(0), prompt="go", image_size=32)
    out = robot_inputs(robot, sample)
    assert out["state"].shape == (robot.state_dim,) and out["prompt"] == "go"
    assert all(img.shape == (32, 32, 3) and img.dtype == np.uint8 for img in out["images"].values())
    assert client_state(robot, sample).shape == (robot.state_dim,)


def test_make_observation_refuses_token_ids_beyond_the_model_vocabulary(tok, tiny):
    small = dataclasses.replace(tiny, vocab_size=10)  # the demo tokenizer's ids reach far beyond 10
    with pytest.raises(ValueError, match="tokenizer ids reach .* model vocabulary has 10 entries"):
        make_observation(robot_config("libero"), small, tok, [_libero()])
