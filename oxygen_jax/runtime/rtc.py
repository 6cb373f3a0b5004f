"""Real-time chunking (RTC): denoise a new action chunk so that it continues the chunk a robot is executing.

Black, Galliker, Levine, arXiv 2506.07339 (guided, inference time) and Black, Ren, Equi, Levine,
arXiv 2512.05964 (training time). The algorithm as the authors' code runs it: `../shared/docs/rtc.md`.

Axes (`oxygen_jax.axes`): B rows (robots), Ha actions per chunk, Ad action dim. Per row b:

    prev_chunk[b]   [Ha, Ad]  the previous chunk aligned to the new one: index i of both is the same
                              control step (kinetix's `prev_action_chunk`: old[s:] then s zero rows)
    delay d         int       actions of the previous chunk executed while this one is computed
    horizon s       int       actions executed from each chunk; the guided region ends at P = Ha - s
    schedule        int       prefix-weight schedule, an index into `SCHEDULES`
    max_guidance β  float     cap of the guidance weight
    mode            int       an index into `MODES`: off, guided (exact VJP), stop_gradient, trained

Prefix weights W [B, Ha] (start = min(d, P)): 1 for i < start; for start <= i < P a ramp
(P - i) / (P - start + 1) ("linear") or w (e^w - 1) / (e - 1) of it ("exp"); 0 for i >= P;
"ones" is 1 for i < P, "zeros" 1 for i < start only. Ha = 10, d = 3, s = 4 (P = 6), linear:
1 1 1 0.75 0.5 0.25 0 0 0 0.

Guided step k (openpi's clock: t = 1 noise -> 0 data; r the remaining time to the data end, as in
`models.flow.run`; tau = 1 - r; direction -1 for π0.5, +1 for 0_to_1 heads):

    v = velocity(x, clock);  x1hat = x + direction * r * v        (the denoised estimate)
    e = W * (prev_chunk - x1hat)
    g = J^T e, J = d x1hat / d x  (exact: a VJP through the velocity, the prefix cache held constant)
      = e                          (stop_gradient: v treated as a constant, LeRobot's variant)
    w = min((1 - tau) / tau * (tau^2 + (1 - tau)^2) / (1 - tau)^2, β)   (β at tau = 0)
    x <- x + dt * (v + direction * w * g)

The velocity closes over the prefix cache (or a head's per-frame state), which is never differentiated:
the VJP runs through the action expert / head only, never into the prefill. Rows whose mode is off take
exactly the plain step `x + dt * v` (bit-identical to `flow.integrate`); the VJP runs only when some row
asks for it (`lax.cond`). Every value is a per-row array: changing d, s, β, the schedule or the previous
chunk never recompiles.

Training-time RTC ("trained", models trained with per-token flow time, `training.flow.rtc`): at every step the
first d actions of x are overwritten with the committed ones and given the clean time (t = 0), the rest
the step's time; the returned chunk starts with the committed actions exactly. It needs a velocity that
takes a per-token time [B, Ha] (π0.5: per-token adaRMS conditioning); other rows are untouched.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models import flow
from oxygen_jax.models import heads as hd

MODES = ("off", "guided", "stop_gradient", "trained")
"""Per-row RTC modes; the row's `mode` is an index into this tuple."""

SCHEDULES = ("zeros", "ones", "linear", "exp")
"""Prefix-weight schedules; the row's `schedule` is an index into this tuple."""

OFF, GUIDED, STOP_GRADIENT, TRAINED = range(4)

TokenVelocity = Callable[[jax.Array, jax.Array], jax.Array]
"""(x [B, Ha, Ad], per-token time t float32 [B, Ha]) -> v [B, Ha, Ad] (training-time RTC)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RtcInputs:
    """Per-row RTC inputs of one denoise call (all arrays; see the module docstring).

    Attributes:
      prev_chunk: float32 [B, Ha, Ad] previous chunk aligned to the new one (normalised model actions).
      delay: int32 [B] inference delay d.
      horizon: int32 [B] execution horizon s (the guided region ends at Ha - s).
      schedule: int32 [B] index into `SCHEDULES`.
      max_guidance: float32 [B] β.
      mode: int32 [B] index into `MODES`.
    """

    prev_chunk: jax.Array
    delay: jax.Array
    horizon: jax.Array
    schedule: jax.Array
    max_guidance: jax.Array
    mode: jax.Array

    @property
    def batch_size(self) -> int:
        return self.prev_chunk.shape[0]


def _index(name: str, value, table: tuple[str, ...], b: int) -> np.ndarray:
    vals = [value] * b if isinstance(value, (str, int, np.integer)) else list(value)
    if len(vals) != b:
        raise ValueError(f"rtc {name} needs one entry per row ({b}), got {len(vals)}")
    out = []
    for v in vals:
        if isinstance(v, str):
            if v not in table:
                raise ValueError(f"rtc {name} {v!r} is not one of {table}")
            v = table.index(v)
        if not 0 <= int(v) < len(table):
            raise ValueError(f"rtc {name} index {v} is out of range: use one of {table} or 0..{len(table) - 1}")
        out.append(int(v))
    return np.asarray(out, np.int32)


def make_inputs(prev_chunk, delay, horizon, *, schedule="exp", max_guidance=5.0, mode="guided") -> RtcInputs:
    """Host helper: checked per-row `RtcInputs` (scalars are broadcast to every row).

    Args:
      prev_chunk: [B, Ha, Ad] aligned previous chunk (row i of the new chunk = row i of this one).
      delay, horizon: d and s, ints or [B]; 0 <= d <= Ha, 0 <= s <= Ha.
      schedule: a name of `SCHEDULES` (or its index), or one per row.
      max_guidance: β >= 0, or [B].
      mode: a name of `MODES` (or its index), or one per row.
    """
    prev = np.asarray(prev_chunk, np.float32)
    if prev.ndim != 3:
        raise ValueError(f"rtc prev_chunk must be [B, Ha, Ad], got shape {prev.shape}")
    b, ha = prev.shape[:2]
    d = np.broadcast_to(np.asarray(delay, np.int64), (b,)).astype(np.int32)
    s = np.broadcast_to(np.asarray(horizon, np.int64), (b,)).astype(np.int32)
    if np.any(d < 0) or np.any(d > ha):
        raise ValueError(f"rtc delay must lie in [0, Ha = {ha}] per row, got {d.tolist()}")
    if np.any(s < 0) or np.any(s > ha):
        raise ValueError(f"rtc horizon (execution horizon s) must lie in [0, Ha = {ha}] per row, got {s.tolist()}")
    beta = np.broadcast_to(np.asarray(max_guidance, np.float32), (b,)).astype(np.float32)
    if not np.all(np.isfinite(beta)) or np.any(beta < 0):
        raise ValueError(f"rtc max_guidance must be finite and >= 0 per row, got {beta.tolist()}")
    return RtcInputs(prev_chunk=prev, delay=d, horizon=s, schedule=_index("schedule", schedule, SCHEDULES, b),
                     max_guidance=beta, mode=_index("mode", mode, MODES, b))


def off(batch: int, horizon: int, action_dim: int) -> RtcInputs:
    """Inputs with RTC off in every row (the plain denoise, bit for bit)."""
    return make_inputs(np.zeros((batch, horizon, action_dim), np.float32), 0, 0, mode="off")


def check_inputs(rtc: RtcInputs, noise_shape: tuple[int, ...]) -> None:
    """Shape checks at the API boundary: one-line errors naming the field and the shape wanted."""
    b = noise_shape[0]
    if tuple(rtc.prev_chunk.shape) != tuple(noise_shape):
        raise ValueError(f"rtc prev_chunk must be shaped like the noise {tuple(noise_shape)}, got {tuple(rtc.prev_chunk.shape)}")
    for name in ("delay", "horizon", "schedule", "max_guidance", "mode"):
        if tuple(getattr(rtc, name).shape) != (b,):
            raise ValueError(f"rtc {name} must be [B] = ({b},), got {tuple(getattr(rtc, name).shape)}")


def prefix_weights(delay: jax.Array, horizon: jax.Array, schedule: jax.Array, ha: int) -> jax.Array:
    """W float32 [B, Ha] from per-row d, s (end P = Ha - s) and schedule index (module docstring)."""
    end = (ha - horizon)[:, None]
    start = jnp.minimum(delay[:, None], end)
    i = jnp.arange(ha, dtype=jnp.int32)[None]
    ramp = jnp.clip((start - 1 - i).astype(jnp.float32) / (end - start + 1).astype(jnp.float32) + 1.0, 0.0, 1.0)
    exp = ramp * jnp.expm1(ramp) / jnp.float32(math.e - 1.0)
    sched = schedule[:, None]
    w = jnp.where(sched == 0, (i < start).astype(jnp.float32),
                  jnp.where(sched == 1, 1.0, jnp.where(sched == 2, ramp, exp)))
    return jnp.where(i >= end, 0.0, w).astype(jnp.float32)


def guidance_weight(remaining: jax.Array, max_guidance: jax.Array) -> jax.Array:
    """w [B] = min(c r^-2, β) at remaining time r = 1 - tau (β at tau = 0, the noise end)."""
    tau = 1.0 - remaining
    inv_r2 = (tau * tau + remaining * remaining) / (remaining * remaining)
    c = jnp.where(tau > 0, remaining / jnp.where(tau > 0, tau, 1.0), jnp.inf)
    return jnp.minimum(c * inv_r2, max_guidance).astype(jnp.float32)


def _guided_update(velocity: flow.Velocity, rtc: RtcInputs, w_prefix: jax.Array, dt: float, direction: float,
                   trace: bool) -> flow.Update:
    prev = rtc.prev_chunk.astype(jnp.float32)
    w3 = w_prefix[:, :, None]
    on = (rtc.mode == GUIDED) | (rtc.mode == STOP_GRADIENT)
    exact_rows = rtc.mode == GUIDED
    need_vjp = jnp.any(exact_rows)
    bshape = (-1,) + (1,) * (prev.ndim - 1)

    def update(x, clock, r):
        # The plain velocity exactly as `flow.integrate` evaluates it (outside any branch), so rows that guide
        # nothing step bit-identically; the pullback recomputes the forward inside its branch (only when some
        # row asks for the exact Jacobian).
        v = velocity(x, clock)
        x1hat = x + (direction * r) * v
        e = w3 * (prev - x1hat)

        def exact(_):
            _, pull = jax.vjp(lambda y: y + (direction * r) * velocity(y, clock), x)
            return pull(e)[0]

        g = jax.lax.cond(need_vjp, exact, lambda _: e, None)
        g = jnp.where(exact_rows.reshape(bshape), g, e)
        w = guidance_weight(r, rtc.max_guidance)
        guided = v + (direction * w).reshape(bshape) * g
        x_next = jnp.where(on.reshape(bshape), x + dt * guided, x + dt * v)
        out = dict(x=x, v=v, x1hat=x1hat, err=e, correction=g, weight=w) if trace else None
        return x_next, out

    return update


def integrate(velocity: flow.Velocity, x0: jax.Array, num_steps: int, direction: float, rtc: RtcInputs, *,
              t0: float | None = None, token_velocity: TokenVelocity | None = None, trace: bool = False):
    """`flow.integrate` with per-row real-time chunking (the same Euler loop, `flow.run`).

    Args:
      velocity: `velocity(x, clock)` on the whole batch, x [B, Ha, Ad] (rows must not interact).
      x0: noise [B, Ha, Ad]; num_steps, direction, t0: as `flow.integrate`.
      rtc: per-row `RtcInputs`.
      token_velocity: `v(x, t [B, Ha])` with per-token time, for rows in mode "trained" (None: the velocity
        has no per-token time; such rows then step plainly, like "off").
      trace: also return the per-step arrays (x entering each step, v, x1hat, err, correction [num_steps,
        B, Ha, Ad], weight [num_steps, B]).
    Returns:
      float32 [B, Ha, Ad], or (that, per-step dict) with `trace`.
    """
    check_inputs(rtc, x0.shape)
    dt = flow.step_size(num_steps, direction)
    w_prefix = prefix_weights(rtc.delay, rtc.horizon, rtc.schedule, x0.shape[1])
    update = _guided_update(velocity, rtc, w_prefix, dt, direction, trace)
    if token_velocity is not None:
        update = _with_inpainting(update, token_velocity, rtc, dt, direction)
    x, outs = flow.run(update, x0, num_steps, direction, t0=t0)
    if token_velocity is not None:
        x = _commit(x, rtc)
    return (x, outs) if trace else x


def _committed_mask(rtc: RtcInputs) -> jax.Array:
    """bool [B, Ha]: positions of trained-mode rows that are overwritten by the committed actions (i < d)."""
    ha = rtc.prev_chunk.shape[1]
    return (rtc.mode == TRAINED)[:, None] & (jnp.arange(ha)[None] < rtc.delay[:, None])


def _commit(x: jax.Array, rtc: RtcInputs) -> jax.Array:
    return jnp.where(_committed_mask(rtc)[:, :, None], rtc.prev_chunk.astype(x.dtype), x)


def _with_inpainting(update: flow.Update, token_velocity: TokenVelocity, rtc: RtcInputs, dt: float,
                     direction: float) -> flow.Update:
    """Training-time RTC for rows in mode "trained": x's committed positions set to the committed actions and
    given the clean time (0 for direction -1, 1 for +1) before each step; the other rows step as `update`."""
    trained = rtc.mode == TRAINED
    mask = _committed_mask(rtc)
    clean = 0.0 if direction < 0 else 1.0

    def step(x, clock, r):
        x_other, out = update(x, clock, r)

        def inpaint(_):
            xc = _commit(x, rtc)
            t_now = r if direction < 0 else 1.0 - r
            t_tok = jnp.where(mask, jnp.float32(clean), jnp.broadcast_to(t_now, mask.shape).astype(jnp.float32))
            return xc + dt * token_velocity(xc, t_tok)

        x_trained = jax.lax.cond(jnp.any(trained), inpaint, lambda _: x_other, None)
        return jnp.where(trained[:, None, None], x_trained, x_other), out

    return step


# --------------------------------------------------------------------------------------------------
# π0.5 and the heads


def denoise_head(params: hd.HeadParams, spec: hd.HeadSpec, st, noise: jax.Array, rtc: RtcInputs, trace: bool = False):
    """A head's `heads.denoise` with per-row RTC (off rows bit-identical to it).

    Heads on the step-index clock (joint_kv, cross_*) take one time per step, so they support "guided" and
    "stop_gradient"; a "trained" row raises when the mode is known on the host (traced, it steps plainly).
    An `adarms_joint` head (π0.5's action expert as a head) keeps the accumulated clock and its per-token
    adaRMS time serves "trained" rows too.
    """
    b = noise.shape[0]
    if spec.per_token_time:  # adarms_joint: the accumulated clock from spec.clock_start, per-token times
        v = lambda x, t: hd.velocity(params, spec, st, x, jnp.broadcast_to(t, (b,)))  # noqa: E731
        tv = lambda x, t_tok: hd.velocity(params, spec, st, x, t_tok)  # noqa: E731
        return integrate(v, noise, spec.num_steps, spec.direction, rtc, t0=spec.clock_start, token_velocity=tv, trace=trace)
    mode = rtc.mode
    if not isinstance(mode, jax.core.Tracer) and np.any(np.asarray(mode) == TRAINED):
        raise ValueError(f"head {spec.name!r} has no per-token time input: training-time RTC ('trained') needs an "
                         "adarms_joint head (π0.5); use 'guided' or 'stop_gradient'")
    v = lambda x, k: hd.velocity(params, spec, st, x, k)  # noqa: E731
    return integrate(v, noise, spec.num_steps, spec.direction, rtc, trace=trace)


def vla_actions(vla, prefix, noises: dict[str, jax.Array], states: dict[str, jax.Array] | None,
                rtc: dict[str, RtcInputs]) -> dict[str, jax.Array]:
    """`vla.actions(prefix, noises, states)` (a `models.vla.MultiHead`) with RTC on the heads named in `rtc`.

    Heads not in `rtc` run their plain denoise; so do rows whose mode is off. Returns head name -> [B, Ha, Ad].
    """
    unknown = sorted(set(rtc) - set(vla.heads))
    if unknown:
        raise ValueError(f"rtc inputs given for heads {unknown}; the model's heads are {vla.heads}")
    states = states or {}
    out = {}
    for h in vla.spec.heads:
        params = vla.params.heads[h.name]
        st = hd.prepare(params, h, prefix, states.get(h.name))
        out[h.name] = (denoise_head(params, h, st, noises[h.name], rtc[h.name]) if h.name in rtc
                       else hd.denoise(params, h, st, noises[h.name]))
    return out


def for_heads(vla, rtc, noises: dict[str, jax.Array]) -> dict[str, RtcInputs] | None:
    """Host check at the API boundary (`Engine.step`): `rtc` as head name -> `RtcInputs`, shapes checked.

    Args:
      rtc: None, one `RtcInputs` (for the model's primary head) or head name -> `RtcInputs`.
      noises: head name -> noise [B, Ha, Ad] of this frame.
    """
    if rtc is None:
        return None
    if isinstance(rtc, RtcInputs):
        rtc = {vla.primary: rtc}
    if not isinstance(rtc, dict) or not all(isinstance(v, RtcInputs) for v in rtc.values()):
        raise ValueError("rtc must be a runtime.rtc.RtcInputs (rtc.make_inputs) or head name -> RtcInputs")
    unknown = sorted(set(rtc) - set(noises))
    if unknown:
        raise ValueError(f"rtc inputs given for heads {unknown}; the model's heads are {tuple(noises)}")
    for name, inputs in rtc.items():
        check_inputs(inputs, tuple(noises[name].shape))
    return {k: jax.tree.map(jnp.asarray, v) for k, v in rtc.items()}
