"""What `Engine` refuses, and how: one-line errors that say what to pass, checked where the value is used.

The specification:

* `step(rows=...)` takes one integer stream id in [0, MAX_STREAM] (or -1, padding) per batch row, each stream
  at most once; anything else is a ValueError naming what to pass. An integer numpy vector is a sequence.
* `submit(row=...)` refuses a stream id no frame can carry (the int32 range), instead of queueing it forever.
* temperature and top-p are checked as the float32 values the device samples with: 1e300 (inf in float32)
  and 1e-300 (0 in float32) are refused, with the accepted range in the message; the edges of the range run.
* an error message never echoes more than a few dozen characters of the caller's value.
* robot states (client samples, and `states=` of multi-head models) must be finite in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from helpers import make_obs
from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.nn import sampling
from oxygen_jax.robots.config import robot_config
from oxygen_jax.robots.normalize import NormStats
from oxygen_jax.robots.transforms import normalize_state, robot_inputs
from oxygen_jax.runtime.engine import MAX_STREAM, Engine, EngineConfig, RequestError

CFG = EngineConfig(num_slots=2, max_new_tokens=4, prompt_capacity=2, admissions_per_frame=2, tokens_per_frame=2,
                   action_horizon=4)


@pytest.fixture(scope="module")
def obs2(tiny_params):
    return make_obs(tiny_params.config, batch=2, cameras=2, lengths=[6, 9], seed=3)


@pytest.fixture()
def eng(tiny_params):
    return Engine(as_vla(tiny_params, 1), CFG)


@pytest.mark.parametrize("rows", [["a", 0], [0, -5], [0, 10**30], [0, 0.5], [True, 0], "ab", [3, 3], [0], 7])
def test_bad_rows_are_one_line_errors_that_say_what_to_pass(eng, obs2, rows):
    with pytest.raises(ValueError) as info:
        eng.step(obs2, rows=rows)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 200
    assert ("pass rows= as a list of 2 integer stream ids" in msg) or ("names a stream twice" in msg)


def test_an_integer_numpy_vector_of_rows_runs_like_the_list(tiny_params, obs2):
    noise = np.asarray(jax.random.normal(jax.random.key(1), (2, CFG.action_horizon, tiny_params.config.action_dim)))
    a = Engine(as_vla(tiny_params, 1), CFG).step(obs2, noise, rows=np.array([4, -1]))
    b = Engine(as_vla(tiny_params, 1), CFG).step(obs2, noise, rows=[4, -1])
    np.testing.assert_array_equal(a.actions, b.actions)


@pytest.mark.parametrize("row", [10**30, MAX_STREAM + 1, -1])
def test_a_row_no_frame_can_carry_is_refused_at_submit_with_the_range(eng, row):
    with pytest.raises(RequestError, match=rf"row must be an integer stream id in \[0, {MAX_STREAM}\]"):
        eng.submit(max_tokens=2, row=row)
    assert eng.num_queued == 0


def test_the_largest_stream_id_is_accepted(eng):
    eng.submit(max_tokens=2, row=MAX_STREAM)
    assert eng.num_queued == 1


@pytest.mark.parametrize("field, value", [
    ("temperature", 1e300), ("temperature", 1e-300), ("temperature", 1e-4), ("temperature", 1e3),
    ("temperature", float("inf")), ("temperature", 10**400), ("top_p", 1e-300), ("top_p", 1e-9), ("top_p", 1.5),
    ("top_p", float("nan")),
])
def test_sampling_values_outside_the_float32_safe_range_are_refused_with_the_range(eng, field, value):
    with pytest.raises(RequestError) as info:
        eng.submit(max_tokens=2, **{field: value})
    rng = "[0.001, 100]" if field == "temperature" else "[1e-06, 1]"
    assert str(info.value).startswith(f"{field} must be") and rng in str(info.value)
    assert eng.num_queued == 0


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=1e-3), dict(temperature=100.0),
                                dict(top_p=1e-6, temperature=1.0), dict(top_p=1)])
def test_the_edges_of_the_sampling_range_are_accepted(eng, kw):
    eng.submit(max_tokens=2, **kw)
    assert eng.num_queued == 1


def test_the_checked_values_are_the_float32_values_the_device_uses():
    assert sampling.check_temperature(0.1) == float(np.float32(0.1)) != 0.1
    assert sampling.check_top_p(np.float64(0.3)) == float(np.float32(0.3))


def test_top_p_at_its_minimum_keeps_the_most_likely_token_where_its_float32_underflow_keeps_none():
    """Why the bound exists: top-p 1e-300 is 0 in float32 and the filter keeps no token (only id 0 is drawn)."""
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3.0
    keys = jax.random.split(jax.random.key(1), 4)
    ones = np.ones((4,), np.float32)
    at_min = sampling.sample_tokens(logits, ones, np.full((4,), sampling.TOP_P_MIN, np.float32), keys)
    np.testing.assert_array_equal(at_min, np.argmax(logits, axis=-1))
    underflow = sampling.sample_tokens(logits, ones, np.full((4,), 1e-300, np.float32), keys)
    assert (np.asarray(underflow) == 0).all() and (np.argmax(logits, axis=-1) != 0).any()


@pytest.mark.parametrize("kw", [dict(max_tokens="x" * 3 * 2**20), dict(max_tokens=2, temperature="t" * 2**20),
                                dict(max_tokens=2, seed=10**5000), dict(max_tokens=2, adapter="a" * 2**20),
                                dict(max_tokens=2, stop_ids=[0] * 2**20), dict(max_tokens=2, row=["r"] * 10**5)])
def test_error_messages_never_echo_a_huge_value(eng, kw):
    with pytest.raises(RequestError) as info:
        eng.submit(**kw)
    assert len(str(info.value)) < 200 and "\n" not in str(info.value)


def _aloha(state):
    img = np.zeros((3, 6, 8), np.uint8)
    return {"state": state, "images": {"cam_high": img, "cam_left_wrist": img, "cam_right_wrist": img}, "prompt": "p"}


def test_a_state_finite_in_float64_but_not_in_float32_is_refused():
    robot = robot_config("aloha")
    state = np.zeros(14)
    state[3] = 1e300
    with pytest.raises(ValueError, match=r"state: the ALOHA joint state holds values beyond float32"):
        robot_inputs(robot, _aloha(state))
    state[3] = 3e38  # representable: accepted
    assert np.isfinite(robot_inputs(robot, _aloha(state))["state"]).all()


def test_a_state_that_normalises_beyond_float32_is_refused():
    dim = 4
    stats = NormStats(mean=np.zeros(dim), std=np.ones(dim), q01=np.zeros(dim), q99=np.full(dim, 1e-3))
    ok = normalize_state(np.full(dim, 0.5e-3, np.float32), {"state": stats})
    np.testing.assert_allclose(ok, 0.0, atol=1e-2)
    with pytest.raises(ValueError, match="beyond float32"):
        normalize_state(np.array([3e38, 0, 0, 0], np.float32), {"state": stats})


def test_a_language_request_is_capped_by_request_max_tokens_where_slots_are_wider(tiny_params):
    """Slots wide enough for a decoded action chunk (π0-FAST: 256) do not widen a language request's cap."""
    eng = Engine(as_vla(tiny_params, 1), dataclasses.replace(CFG, max_new_tokens=6, request_max_tokens=3))
    assert eng.limits.max_new_tokens == 3
    with pytest.raises(RequestError, match=r"max_tokens must be an integer in \[1, 3\]"):
        eng.submit([1, 2], max_tokens=4)
    with pytest.raises(ValueError, match=r"request_max_tokens must be in \[1, max_new_tokens = 6\]"):
        dataclasses.replace(CFG, max_new_tokens=6, request_max_tokens=7)
