"""Real-time chunking (runtime/rtc.py): the authors' and LeRobot's samplers reproduced (../shared/fixtures/rtc_reference),
the fixture's own relations, RTC-off rows bit-identical to plain denoise beside RTC rows (π0.5 tiny and a tiny
head), one compile over changing per-row inputs, and training-time RTC's committed prefix."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_obs, shared_dir
from oxygen_jax.models import backbone as bb
from oxygen_jax.models import heads as hd
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import init_params
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.runtime import rtc

FIXTURE = shared_dir() / "fixtures" / "rtc_reference"


# --------------------------------------------------------------------------------------------------
# The reference fixture


@pytest.fixture(scope="module")
def ref():
    if not FIXTURE.is_dir():
        pytest.skip(f"../shared fixtures not present: {FIXTURE} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    from eval.parity import rtc as parity

    meta, arrays = parity.load(FIXTURE)
    rows = parity.run_fixture(FIXTURE)
    return parity, meta, arrays, rows


def _case_names():
    import json

    path = FIXTURE / "meta.json"
    return [c["name"] for c in json.loads(path.read_text())["cases"]] if path.is_file() else ["absent"]


@pytest.mark.parametrize("case", _case_names())
def test_every_fixture_case_matches_kinetix_exact_and_lerobot_stop_gradient_per_step_and_final(ref, case):
    """Exact guidance vs kinetix's `realtime_action`, stop-gradient vs kinetix_sg and LeRobot: x, v, x1hat, err,
    correction, weight per step and the final chunk, to 1e-5; prefix weights to 1e-6; plain Euler vs both."""
    _, _, _, rows = ref
    mine = [r for r in rows if r.quantity.startswith(case + "/")]
    refs = {r.quantity.split("/")[1] for r in mine}
    assert refs >= {"kinetix", "kinetix_sg", "lerobot", "euler_kinetix", "euler_lerobot", "relations"}
    assert len(mine) == 26, [r.quantity for r in mine]
    failed = [(r.quantity, r.max_abs, r.tol) for r in mine if not r.ok]
    assert not failed, failed


def test_fixture_relations_beta0_is_euler_exact_differs_from_stop_gradient_and_x_free_model_agrees(ref):
    """β = 0 (case s00) is plain Euler bit for bit; exact and stop-gradient differ by what the fixture says
    (>= 0.05) and both differ from Euler; with a velocity that ignores x (W1[:, :Ha*Ad] = 0) J = I and the
    exact VJP equals the stop-gradient result."""
    parity, meta, arrays, _ = ref
    cases = {c["name"]: c for c in meta["cases"]}
    s00 = cases["s00"]
    assert s00["max_guidance_weight"] == 0.0
    beta0 = parity.run_case(s00, arrays, "guided", trace=False)
    np.testing.assert_array_equal(np.asarray(beta0), np.asarray(parity.plain_euler(s00, arrays)))

    c09 = cases["c09"]  # the fixture's smallest exact-vs-stop-gradient gap (0.258)
    exact = np.asarray(parity.run_case(c09, arrays, "guided", trace=False))
    sg = np.asarray(parity.run_case(c09, arrays, "stop_gradient", trace=False))
    euler = np.asarray(parity.plain_euler(c09, arrays))
    assert np.max(np.abs(exact - sg)) >= 0.05 and np.max(np.abs(exact - euler)) >= 0.05

    flat = arrays["c09/a_prev"].shape[1] * arrays["c09/a_prev"].shape[2]
    free = dict(arrays)
    free["model/W1"] = arrays["model/W1"].copy()
    free["model/W1"][:, :flat] = 0.0
    np.testing.assert_allclose(parity.run_case(c09, free, "guided", trace=False),
                               parity.run_case(c09, free, "stop_gradient", trace=False), atol=2e-6, rtol=0)


def test_exact_correction_is_the_analytic_jacobian_transpose_of_the_mlp(ref):
    """At step 0 (shared x_0): g = e - t (dv/dx)^T e with the MLP's float64 analytic Jacobian."""
    parity, meta, arrays, _ = ref
    mc = {c["name"]: c for c in meta["cases"]}["c02"]
    _, steps = parity.run_case(mc, arrays, "guided")
    w1, b1, w2 = (arrays[f"model/{k}"].astype(np.float64) for k in ("W1", "b1", "W2"))
    x0 = arrays["c02/noise"].astype(np.float64)
    b, ha, ad = x0.shape
    e = np.asarray(steps["err"][0], np.float64)
    for row in range(b):
        z = np.concatenate([x0[row].ravel(), [1.0], arrays["c02/obs"][row]])
        u = w1 @ z + b1
        k = np.sqrt(2 / np.pi)
        th = np.tanh(k * (u + 0.044715 * u ** 3))
        dg = 0.5 * (1 + th) + 0.5 * u * (1 - th ** 2) * k * (1 + 3 * 0.044715 * u ** 2)
        jac = w2 @ (dg[:, None] * w1[:, : ha * ad])  # dv/dx [Ha*Ad, Ha*Ad]
        want = e[row].ravel() - 1.0 * jac.T @ e[row].ravel()  # t_0 = 1
        np.testing.assert_allclose(np.asarray(steps["correction"][0, row]).ravel(), want, atol=2e-5)


def test_prefix_weights_worked_example_and_clamped_start():
    """The docstring's example (Ha 10, d 3, s 4, linear), every schedule, and d > P (start clamped to P)."""
    d, s = jnp.asarray([3, 3, 3, 3, 5]), jnp.asarray([4, 4, 4, 4, 7])
    w = np.asarray(rtc.prefix_weights(d, s, jnp.asarray([2, 3, 1, 0, 2]), 10))
    np.testing.assert_allclose(w[0], [1, 1, 1, 0.75, 0.5, 0.25, 0, 0, 0, 0], atol=1e-7)
    ramp = np.asarray([0.75, 0.5, 0.25])
    np.testing.assert_allclose(w[1, 3:6], ramp * np.expm1(ramp) / (np.e - 1), atol=1e-7)
    np.testing.assert_array_equal(w[2], [1] * 6 + [0] * 4)
    np.testing.assert_array_equal(w[3], [1] * 3 + [0] * 7)
    np.testing.assert_array_equal(w[4], [1] * 3 + [0] * 7)  # P = 3 < d = 5: the first P actions only


def test_bad_inputs_are_one_line_errors():
    prev = np.zeros((2, 4, 3), np.float32)
    for kwargs, msg in [
        (dict(delay=5, horizon=1), r"delay must lie in \[0, Ha = 4\]"),
        (dict(delay=1, horizon=-1), r"horizon \(execution horizon s\) must lie in \[0, Ha = 4\]"),
        (dict(delay=1, horizon=1, schedule="cosine"), "schedule 'cosine' is not one of"),
        (dict(delay=1, horizon=1, mode="fast"), "mode 'fast' is not one of"),
        (dict(delay=1, horizon=1, max_guidance=-1.0), "max_guidance must be finite and >= 0"),
        (dict(delay=[1, 2, 3], horizon=1), "broadcast"),
    ]:
        with pytest.raises(ValueError, match=msg):
            rtc.make_inputs(prev, **kwargs)
    with pytest.raises(ValueError, match=r"prev_chunk must be shaped like the noise \(2, 5, 3\)"):
        rtc.check_inputs(rtc.make_inputs(prev, 1, 1), (2, 5, 3))


# --------------------------------------------------------------------------------------------------
# π0.5 tiny


@pytest.fixture(scope="module")
def pi05():
    cfg = model_config("tiny")
    params = init_params(cfg, 0)
    cache = model.prefill(params, make_obs(cfg, batch=3))
    rng = np.random.default_rng(5)
    ha = 6
    noise = jnp.asarray(rng.standard_normal((3, ha, cfg.action_dim)), jnp.float32)
    prev = rng.standard_normal((3, ha, cfg.action_dim)).astype(np.float32)
    return params, cache, noise, prev


def _prefix_error(actions, prev, d):
    return float(np.sqrt(np.mean((np.asarray(actions)[:d] - prev[:d]) ** 2)))


@functools.partial(jax.jit, static_argnames=("num_steps",))
def _denoise_pi05(params, cache, noise, inputs, num_steps=10):
    """π0.5's denoise with per-row RTC: its action expert as the adarms_joint head of `as_model` (`rtc.denoise_head`)."""
    spec, weights = model.as_model(params, num_steps)
    head = spec.heads[0]
    st = hd.prepare(weights.heads[head.name], head, cache, None)
    return rtc.denoise_head(weights.heads[head.name], head, st, noise, inputs)


def test_pi05_rtc_off_rows_are_bit_identical_to_plain_denoise_beside_guided_rows(pi05):
    """Row 0 off, row 1 exact guidance, row 2 stop-gradient in one batch: row 0 equals `model.denoise` bit for bit;
    the guided rows differ from it and start closer to their previous chunk."""
    params, cache, noise, prev = pi05
    plain = np.asarray(model.denoise(params, cache, noise, 10))
    inputs = rtc.make_inputs(prev, [2, 2, 2], [3, 3, 3], schedule="exp", max_guidance=5.0,
                             mode=["off", "guided", "stop_gradient"])
    got = np.asarray(_denoise_pi05(params, cache, noise, inputs, 10))
    np.testing.assert_array_equal(got[0], plain[0])
    for row in (1, 2):
        assert np.max(np.abs(got[row] - plain[row])) > 1e-2
        assert _prefix_error(got[row], prev[row], 2) < _prefix_error(plain[row], prev[row], 2)
    assert np.max(np.abs(got[1] - got[2])) > 1e-4  # the action expert's Jacobian is used
    all_off = np.asarray(_denoise_pi05(params, cache, noise, rtc.off(3, *noise.shape[1:]), 10))
    np.testing.assert_array_equal(all_off, plain)


def test_pi05_one_compile_over_changing_delay_horizon_previous_chunk_and_modes(pi05):
    params, cache, noise, prev = pi05
    rng = np.random.default_rng(0)
    before = _denoise_pi05._cache_size()
    for d, s, mode in [(0, 2, "guided"), (1, 3, "stop_gradient"), ([2, 0, 4], [4, 1, 2], ["off", "guided", "trained"])]:
        inputs = rtc.make_inputs(prev + rng.standard_normal(prev.shape).astype(np.float32), d, s,
                                 schedule=["exp", "linear", "ones"], max_guidance=[1.0, 5.0, 10.0], mode=mode)
        jax.block_until_ready(_denoise_pi05(params, cache, noise, inputs, 10))
    assert _denoise_pi05._cache_size() - before <= 1


def test_pi05_training_time_rtc_reproduces_the_committed_prefix_exactly(pi05):
    """Mode "trained": the first d actions are the committed ones bit for bit; the other rows are unchanged and
    the postfix is a denoised chunk (it moves with the noise)."""
    params, cache, noise, prev = pi05
    plain = np.asarray(model.denoise(params, cache, noise, 10))
    inputs = rtc.make_inputs(prev, [3, 1, 0], [3, 3, 3], mode=["trained", "trained", "off"])
    got = np.asarray(_denoise_pi05(params, cache, noise, inputs, 10))
    np.testing.assert_array_equal(got[0, :3], prev[0, :3])
    np.testing.assert_array_equal(got[1, :1], prev[1, :1])
    np.testing.assert_array_equal(got[2], plain[2])
    assert np.max(np.abs(got[0, 3:] - prev[0, 3:])) > 1e-2
    again = np.asarray(_denoise_pi05(params, cache, noise + 0.5, inputs, 10))
    np.testing.assert_array_equal(again[0, :3], prev[0, :3])
    assert np.max(np.abs(again[0, 3:] - got[0, 3:])) > 1e-3


def test_per_token_time_with_equal_times_is_the_per_row_velocity(pi05):
    """π0.5's per-token adaRMS path with every token at the row's time equals the per-row path (to rounding)."""
    params, cache, noise, _ = pi05
    t = jnp.asarray([1.0, 0.5, 0.2], jnp.float32)
    per_row = model.velocity(params, cache, noise, t)
    per_tok = model.velocity(params, cache, noise, jnp.broadcast_to(t[:, None], noise.shape[:2]))
    np.testing.assert_allclose(per_tok, per_row, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------
# A tiny head (XR0-style joint_kv, t from 0 to 1) on a synthetic prefix


def _synthetic_prefix(b: int = 3, p: int = 7) -> Prefix:
    spec = bb.preset("qwen3vl_tiny")
    rng = np.random.default_rng(1)
    ell, k, h, d = spec.depth, spec.num_kv_heads, spec.head_dim, spec.width
    mask = np.ones((b, p), bool)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return Prefix(
        k=normal(ell, b, p, k, h), v=normal(ell, b, p, k, h), hidden=normal(ell + 1, b, p, d), mask=jnp.asarray(mask),
        positions=jnp.asarray(np.cumsum(mask, -1) - 1, jnp.int32), next_position=jnp.full((b,), p, jnp.int32),
        last_hidden=None, kv_layers=tuple(range(ell)), hidden_layers=tuple(range(ell + 1)), rope=spec.rope,
    )


@functools.partial(jax.jit, static_argnums=1)
def _head_plain(params, spec, prefix, noise, state):
    return hd.denoise(params, spec, hd.prepare(params, spec, prefix, state), noise)


@functools.partial(jax.jit, static_argnums=1)
def _head_rtc(params, spec, prefix, noise, state, inputs):
    return rtc.denoise_head(params, spec, hd.prepare(params, spec, prefix, state), noise, inputs)


def test_head_rtc_off_rows_bit_identical_and_guided_rows_follow_the_previous_chunk():
    spec = hd.preset("xr0_tiny")
    params = hd.init_head(spec, 3)
    prefix = _synthetic_prefix()
    rng = np.random.default_rng(2)
    noise = jnp.asarray(rng.standard_normal((3, spec.horizon, spec.action_dim)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((3, spec.state_dim)), jnp.float32) if spec.state_dim else None
    prev = rng.standard_normal((3, spec.horizon, spec.action_dim)).astype(np.float32)
    plain = np.asarray(_head_plain(params, spec, prefix, noise, state))
    d = max(1, spec.horizon // 2)
    inputs = rtc.make_inputs(prev, d, 1, schedule="ones", max_guidance=float(spec.num_steps),
                             mode=["guided", "off", "stop_gradient"])
    got = np.asarray(_head_rtc(params, spec, prefix, noise, state, inputs))
    np.testing.assert_array_equal(got[1], plain[1])
    for row in (0, 2):
        assert _prefix_error(got[row], prev[row], d) < _prefix_error(plain[row], prev[row], d)
    with pytest.raises(ValueError, match="training-time RTC"):
        rtc.denoise_head(params, spec, hd.prepare(params, spec, prefix, state), noise,
                         rtc.make_inputs(prev, d, 1, mode="trained"))


# --------------------------------------------------------------------------------------------------
# Training-time RTC: the training side


def test_training_loss_counts_the_postfix_only_with_clean_prefix_tokens(pi05):
    """d = 0 is the plain flow-matching loss (per-token time equal to the row's); with d > 0 the prefix enters clean,
    so noise under the prefix changes nothing, and the loss averages the postfix entries only."""
    from training.flow import rtc as train_rtc

    params, _, noise, _ = pi05
    cfg = params.config
    obs = make_obs(cfg, batch=3)
    rng = np.random.default_rng(9)
    actions = jnp.asarray(rng.standard_normal(noise.shape), jnp.float32)
    time = jnp.asarray([0.9, 0.5, 0.2], jnp.float32)
    plain = model.compute_loss(params, obs, actions, noise, time)
    loss0, mask0 = train_rtc.compute_loss(params, obs, actions, noise, time, jnp.zeros(3, jnp.int32))
    np.testing.assert_allclose(loss0, plain, atol=1e-5, rtol=1e-5)
    assert bool(np.all(mask0))

    delay = jnp.asarray([2, 0, 5], jnp.int32)
    loss, mask = train_rtc.compute_loss(params, obs, actions, noise, time, delay)
    np.testing.assert_array_equal(mask, np.arange(noise.shape[1])[None] >= np.asarray(delay)[:, None])
    under = jnp.where(~mask[:, :, None], noise + 3.0, noise)  # other noise under the committed prefix only
    loss_u, _ = train_rtc.compute_loss(params, obs, actions, under, time, delay)
    np.testing.assert_array_equal(np.asarray(loss_u)[np.asarray(mask)], np.asarray(loss)[np.asarray(mask)])
    m = np.asarray(mask, np.float64)
    np.testing.assert_allclose(train_rtc.masked_mean(loss, mask), np.sum(np.asarray(loss) * m) / m.sum(), rtol=1e-6)
    d = np.asarray(train_rtc.sample_delay(jax.random.key(0), 4000, train_rtc.RtcTrainConfig(max_delay=3)))
    assert set(np.unique(d)) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="max_delay must be >= 0"):
        train_rtc.RtcTrainConfig(max_delay=-1)


# --------------------------------------------------------------------------------------------------
# The closed-loop sweep's task (eval/rtc_sweep.py)


def test_sweep_task_expert_passes_both_walls_and_at_zero_delay_synchronous_is_naive_async():
    """The scripted expert reaches the goal through every gap choice without touching a wall (also with the
    training data's noise and stops: `demonstrations` asserts it), and with d = 0 synchronous and naive
    asynchronous execution are the same schedule (same chunks, same results)."""
    from eval import rtc_sweep as sweep

    obs, chunks = sweep.demonstrations(40, np.random.default_rng(0))
    assert obs.shape == (40 * sweep.T_MAX, 4) and chunks.shape == (40 * sweep.T_MAX, sweep.HA, sweep.AD)
    gaps = np.array([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
    ep = sweep.Episodes.start(len(gaps))
    while ep.t < sweep.T_MAX:
        ep.execute(sweep.expert_action(ep.p, gaps))
    assert ep.done.all() and not ep.failed.any()
    params = sweep.init_mlp(jax.random.key(0), width=16)
    runs = [sweep.run_method(m, 0, 4, params, np.random.default_rng(1), 6) for m in ("synchronous", "naive_async")]
    assert runs[0] == runs[1]
