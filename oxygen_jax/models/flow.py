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

The loop is a `fori_loop` with a static count; the velocity closes over read-only per-frame state
(a prefix cache, a head's K/V) that it never writes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Velocity = Callable[[jax.Array, jax.Array], jax.Array]  # (x [...], tau []) -> v, shaped like x


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
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    dt = float(direction) / num_steps
    x0 = x0.astype(jnp.float32)
    if t0 is None:
        return jax.lax.fori_loop(0, num_steps, lambda k, x: x + dt * velocity(x, k), x0)

    def step(_, carry):
        x, t = carry
        return x + dt * velocity(x, t), t + dt

    x, _ = jax.lax.fori_loop(0, num_steps, step, (x0, jnp.float32(t0)))
    return x
