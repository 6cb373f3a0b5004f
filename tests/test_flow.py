"""The one Euler loop (models/flow.py) against hand-written loops: both clocks, both directions, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxygen_jax.models import flow


def _velocity(x, tau):
    """A nonlinear field that reads the time argument, so a wrong clock changes the result."""
    return jnp.sin(x) * (1.0 + tau.astype(jnp.float32)) - 0.5 * x


def _x0():
    return jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 4)), jnp.float32)


@pytest.mark.parametrize("num_steps", [1, 3, 10])
def test_accumulated_clock_is_the_hand_written_float32_loop(num_steps):
    """π0.5's schedule: t starts at 1 and is accumulated in float32 with dt = -1/S (not recomputed as 1 - k/S)."""
    got = jax.jit(lambda x: flow.integrate(_velocity, x, num_steps, -1.0, t0=1.0))(_x0())

    def hand(x):  # openpi's while loop; a loop body, not unrolled code, so both compile to the same kernels
        dt = -1.0 / num_steps

        def body(_, carry):
            x, t = carry
            return x + dt * _velocity(x, t), t + dt

        return jax.lax.fori_loop(0, num_steps, body, (x, jnp.float32(1.0)))[0]

    np.testing.assert_array_equal(got, jax.jit(hand)(_x0()))


@pytest.mark.parametrize("direction", [1.0, -1.0])
def test_step_index_clock_hands_the_velocity_k(direction):
    """The heads' schedule: the velocity receives the int32 step index k = 0 .. S-1 and derives its own time."""
    seen = []

    def v(x, k):
        seen.append(k.dtype)
        return _velocity(x, k.astype(jnp.float32) / 4)

    got = jax.jit(lambda x: flow.integrate(v, x, 4, direction))(_x0())

    def hand(x):
        def body(k, x):
            return x + (direction / 4) * _velocity(x, k.astype(jnp.float32) / 4)

        return jax.lax.fori_loop(0, 4, body, x)

    np.testing.assert_array_equal(got, jax.jit(hand)(_x0()))
    assert seen and all(d == jnp.int32 for d in seen)


def test_the_start_point_is_cast_to_float32_and_the_step_count_is_checked():
    out = flow.integrate(lambda x, t: -x, jnp.ones((2,), jnp.bfloat16), 2, -1.0, t0=1.0)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.full((2,), 2.25, np.float32))  # x *= 1.5 twice
    with pytest.raises(ValueError, match="num_steps must be >= 1, got 0"):
        flow.integrate(lambda x, t: x, jnp.ones((2,)), 0, 1.0)
