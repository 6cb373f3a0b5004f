"""The one Euler loop of flow matching: π0.5 and every action head integrate their velocity with it.

Shapes: x is whatever the velocity returns for it (actions [B, Ha, Ad], `oxygen_jax.axes`), in float32.

    x_{k+1} = x_k + dt * v(x_k, tau_k),    k = 0 .. num_steps - 1,    dt = direction / num_steps

The time argument tau_k is one of two clocks, kept apart so that each model keeps the rounding of
its reference implementation (openpi's loop for π0.5, the heads' public code):

* `t0` given ("accumulated", π0.5 / openpi): tau_k is a float32 time carried through the loop,
  t0 then t0 + dt, t0 + 2 dt, ... each sum rounded in float32. With t0 = 1 and dt = -1/10 the
  last time is 0.09999993, not 0.1.
* `t0` None ("step index", the heads): tau_k is the int32 step index k; the velocity derives its
  own time from it exactly (k / S, or an integer bucket floor(k * 1000 / S)).

`integrate` is the plain loop. `run` is the same loop with the update itself handed in, for samplers
that change the step (real-time chunking's guidance and prefix inpainting, `runtime.rtc`): the update
sees x, the clock and the remaining time r_k to the data end (1 at the noise end, 0 at the data end;
with the accumulated clock r = t for direction -1 and 1 - t for +1, with the step index
r = (S - k) / S), and may return one per-step output (stacked to [num_steps, ...]).

The loop is a static-count scan; the velocity closes over read-only per-frame state (a prefix cache,
a head's K/V) that it never writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Velocity = Callable[[jax.Array, jax.Array], jax.Array]  # (x [...], tau []) -> v, shaped like x
Update = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]
"""(x, clock, remaining r float32 []) -> (x after this step, a per-step output or None)."""


def step_size(num_steps: int, direction: float) -> float:
    """dt = direction / num_steps (a Python float: every sampler multiplies by the same constant)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return float(direction) / num_steps


def run(update: Update, x0: jax.Array, num_steps: int, direction: float, *,
        t0: float | None = None) -> tuple[jax.Array, Any]:
    """`num_steps` applications of `update` from `x0` (cast to float32) on one of the two clocks.

    Args:
      update: `update(x, clock, remaining)` -> (next x, per-step output or None); clock is what the
        velocity reads (float32 t with `t0`, the int32 step index without), remaining r as above.
      x0, num_steps, direction, t0: as `integrate`.
    Returns:
      (float32 x after the last step, the per-step outputs stacked on a leading [num_steps] axis).
    """
    dt = step_size(num_steps, direction)
    x0 = x0.astype(jnp.float32)
    if t0 is None:
        def by_index(x, k):
            return update(x, k, (num_steps - k).astype(jnp.float32) / num_steps)

        return jax.lax.scan(by_index, x0, jnp.arange(num_steps, dtype=jnp.int32))

    def accumulated(carry, _):
        x, t = carry
        x, out = update(x, t, t if direction < 0 else 1.0 - t)
        return (x, t + dt), out

    (x, _), outs = jax.lax.scan(accumulated, (x0, jnp.float32(t0)), None, length=num_steps)
    return x, outs


def integrate(velocity: Velocity, x0: jax.Array, num_steps: int, direction: float, *,
              t0: float | None = None) -> jax.Array:
    """`num_steps` Euler steps of `velocity` from `x0` (cast to float32).

    Args:
      velocity: `velocity(x, tau)`; tau is float32 [] (with `t0`) or the int32 step index [] (without).
      x0: the start point (noise), e.g. [B, Ha, Ad].
      num_steps: static step count, >= 1.
      direction: -1.0 from t = 1 (noise) to t = 0 (π0.5, `1_to_0` heads), +1.0 from 0 to 1.
      t0: the start time of an accumulated float32 clock; None hands `velocity` the step index.
    Returns:
      float32 x after `num_steps` steps, shaped like `x0`.
    """
    dt = step_size(num_steps, direction)
    x, _ = run(lambda x, clock, _r: (x + dt * velocity(x, clock), None), x0, num_steps, direction, t0=t0)
    return x
