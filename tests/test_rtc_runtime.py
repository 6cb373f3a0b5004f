"""Real-time chunking through `Engine.step` (per-row `rtc=`): RTC-off rows bit-identical to a step without RTC in a
batch with RTC rows, language tokens unchanged by RTC, one compile over frames whose d, s, previous chunks and
modes change, and `Engine.warmup(rtc=...)` compiling that program. The denoise-level relations (fixture parity,
off rows beside guided rows in π0.5's head, other heads) are tests/test_rtc.py's."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import diverse_text_params, make_obs
from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.runtime import frame, rtc
from oxygen_jax.runtime.engine import Engine, EngineConfig

HA, B = 5, 3  # a horizon no other test module uses: the compile counts below are this module's own
CFG = EngineConfig(num_slots=2, max_new_tokens=4, prompt_capacity=0, admissions_per_frame=2, tokens_per_frame=2,
                   action_horizon=HA)
FRAMES = 4


@pytest.fixture(scope="module")
def params(tiny_params):
    return diverse_text_params(tiny_params)


def _aligned(chunk: np.ndarray, s: int) -> np.ndarray:
    """kinetix's `prev_action_chunk`: the chunk shifted by the s actions executed, then s zero rows."""
    return np.concatenate([chunk[s:], np.zeros_like(chunk[:s])], axis=0)


def _frame_inputs(f: int, last: np.ndarray | None) -> rtc.RtcInputs:
    """Frame f's per-row RTC: row 0 always off, rows 1 and 2 cycle through modes, d and s change every frame."""
    if last is None:
        return rtc.off(B, HA, 32)
    d, s = [0, 1 + f % 2, 2], [1, 2 + f % 2, 2]
    modes = ["off", ("guided", "stop_gradient")[f % 2], ("trained", "guided")[f % 2]]
    prev = np.stack([_aligned(last[i], s[i]) for i in range(B)])
    return rtc.make_inputs(prev, d, s, schedule=["exp", "linear", "ones"][f % 3], max_guidance=[5.0, 3.0, 2.0],
                           mode=modes)


@pytest.fixture(scope="module")
def runs(params):
    """The same frames (observation, noise, language requests) through two engines: without RTC, and with
    per-row RTC inputs built from the previous chunk each frame. Returns both engines' results and the inputs."""
    obs = make_obs(params.config, batch=B, cameras=2, lengths=[6, 8, 7], seed=4)
    rng = np.random.default_rng(7)
    noises = [rng.standard_normal((B, HA, 32)).astype(np.float32) for _ in range(FRAMES)]
    out = {}
    for name in ("plain", "rtc"):
        eng = Engine(as_vla(params, 3), CFG)
        eng.submit(max_tokens=4, stop_ids=(), row=1)  # the language rides on a guided robot's prefix
        eng.submit(max_tokens=3, stop_ids=(), row=0)
        before = frame.frame_step._cache_size()
        results, inputs, last = [], [], None
        for f in range(FRAMES):
            kw = {}
            if name == "rtc":
                inputs.append(_frame_inputs(f, last))
                kw["rtc"] = inputs[-1]
            results.append(eng.step(obs, noises[f], **kw))
            last = results[-1].actions
        out[name] = dict(results=results, inputs=inputs, compiles=frame.frame_step._cache_size() - before)
    return out


def test_rtc_off_rows_are_bit_identical_to_a_step_without_rtc_beside_rtc_rows(runs):
    """Row 0 (mode off every frame) equals the plain engine's row 0 bit for bit in every frame, while rows 1
    and 2 (guided / stop-gradient / trained) differ from their plain rows from frame 1 on."""
    plain, guided = runs["plain"]["results"], runs["rtc"]["results"]
    np.testing.assert_array_equal(guided[0].actions, plain[0].actions)  # frame 0: every row off
    for f in range(1, FRAMES):
        np.testing.assert_array_equal(guided[f].actions[0], plain[f].actions[0])
        for row in (1, 2):
            assert np.max(np.abs(guided[f].actions[row] - plain[f].actions[row])) > 1e-3, (f, row)


def test_guided_rows_continue_their_previous_chunk_and_trained_rows_reproduce_the_committed_prefix(runs):
    plain, res, inputs = runs["plain"]["results"], runs["rtc"]["results"], runs["rtc"]["inputs"]
    for f in range(1, FRAMES):
        x = inputs[f]
        for row in (1, 2):
            d = int(x.delay[row])
            mode = rtc.MODES[int(x.mode[row])]
            if mode == "trained":
                np.testing.assert_array_equal(res[f].actions[row, :d], x.prev_chunk[row, :d])
                continue
            end = HA - int(x.horizon[row])  # the guided region (weights > 0) ends here
            err = lambda a: np.sqrt(np.mean((a[:end] - x.prev_chunk[row, :end]) ** 2))  # noqa: E731
            assert err(res[f].actions[row]) < err(plain[f].actions[row]), (f, row, mode)


def test_language_tokens_are_identical_with_rtc_on_and_off(runs):
    """The requests read the same prefix (frozen during guidance): the same tokens, finishing in the same frames."""
    def tokens(results):
        return {(r.request_id, r.finish_frame): r.tokens for res in results for r in res.finished}

    plain, guided = tokens(runs["plain"]["results"]), tokens(runs["rtc"]["results"])
    assert len(plain) == 2 and all(len(t) >= 3 for t in plain.values())
    assert guided == plain


def test_one_compile_over_frames_with_changing_delay_horizon_previous_chunk_and_modes(runs):
    assert runs["rtc"]["compiles"] == 1 and runs["plain"]["compiles"] == 1


def test_warmup_with_rtc_compiles_the_rtc_program_and_bad_rtc_inputs_are_one_line_errors(params):
    eng = Engine(as_vla(params, 3), CFG)
    obs = make_obs(params.config, batch=2, cameras=2, seed=5)  # B = 2: a shape the fixture did not compile
    before = frame.frame_step._cache_size()
    eng.warmup(obs, rtc=rtc.off(2, HA, 32))
    assert frame.frame_step._cache_size() - before == 1
    prev = np.zeros((2, HA, 32), np.float32)
    eng.step(obs, rtc=rtc.make_inputs(prev, [1, 0], [2, 2], mode=["guided", "off"]))
    assert frame.frame_step._cache_size() - before == 1  # warm: the first RTC step does not compile
    with pytest.raises(ValueError, match=r"prev_chunk must be shaped like the noise \(2, 5, 32\)") as e:
        eng.step(obs, rtc=rtc.make_inputs(np.zeros((2, HA + 1, 32), np.float32), 1, 1))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="rtc must be a runtime.rtc.RtcInputs"):
        eng.step(obs, rtc={"actions": "guided"})
