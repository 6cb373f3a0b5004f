"""Real-time chunking parity: `runtime.rtc` against the authors' sampler and LeRobot's (`../shared/fixtures/rtc_reference`).

    python -m eval.parity ../shared/fixtures/rtc_reference

The fixture (its README) holds a small MLP velocity model (weights and formula), and for every case the
inputs (noise, aligned previous chunk, per-row d, s), and the outputs of kinetix's `realtime_action`
(exact VJP, `kinetix/`), the same code with a stop-gradient model (`kinetix_sg/`), LeRobot's guided
`RTCProcessor` (identity Jacobian, `lerobot/`) and plain Euler, per step and final. Every case runs here
as one call with per-row d and s (the references ran rows of mixed cases one at a time), in mode
"guided" against `kinetix/` and "stop_gradient" against `kinetix_sg/` and `lerobot/`:

* final actions and per-step x, v (kinetix's sign is -v), x1hat, err, correction: atol 1e-5;
  guidance weight: rtol 1e-5 (the time grids differ by float32 ulps); prefix weights: atol 1e-6;
* plain Euler (`flow.integrate`) against both references' Euler;
* the fixture's relations on our own sampler: a beta = 0 row, an all-zero-weight row and an "off" row each
  equal our plain Euler bit for bit, in a batch with guided rows.

Axes: B rows, Ha = H actions, Ad = A action dims, O observation floats (all read from the fixture).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity.checks import Checker, Row
from oxygen_jax.models import flow
from oxygen_jax.runtime import rtc

_TOL = {"weight": (0.0, 1e-5), "prefix_weights": (1e-6, None)}


def _tolerance(quantity: str, family: str | None):
    return _TOL.get(quantity.rsplit("/", 1)[-1], (1e-5, None))


def is_rtc_fixture(path: Path) -> bool:
    """A directory with `meta.json` naming the `rtc_reference` fixture and its `reference.npz`."""
    meta = Path(path) / "meta.json"
    if not meta.is_file() or not (Path(path) / "reference.npz").is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("fixture") == "rtc_reference"
    except (ValueError, OSError):
        return False


def load(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of the fixture."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    with np.load(path / "reference.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return meta, arrays


def mlp_velocity(arrays: dict[str, np.ndarray], obs: jax.Array):
    """The fixture's velocity v(x [B, Ha, Ad], t []) (openpi convention), rows independent."""
    w1, b1, w2, b2 = (jnp.asarray(arrays[f"model/{k}"]) for k in ("W1", "b1", "W2", "b2"))
    hi = jax.lax.Precision.HIGHEST

    def v(x, t):
        b = x.shape[0]
        t_col = jnp.broadcast_to(jnp.asarray(t, jnp.float32).reshape(-1, 1), (b, 1))
        z = jnp.concatenate([x.reshape(b, -1), t_col, obs], axis=1)
        g = jax.nn.gelu(jnp.dot(z, w1.T, precision=hi) + b1, approximate=True)
        return (jnp.dot(g, w2.T, precision=hi) + b2).reshape(x.shape)

    return v


@functools.partial(jax.jit, static_argnames=("num_steps", "trace"))
def _sample(arrays, obs, noise, inputs, num_steps: int, trace: bool = True):
    return rtc.integrate(mlp_velocity(arrays, obs), noise, num_steps, -1.0, inputs, t0=1.0, trace=trace)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def _euler(arrays, obs, noise, num_steps: int):
    return flow.integrate(mlp_velocity(arrays, obs), noise, num_steps, -1.0, t0=1.0)


def _model_arrays(arrays):
    return {k: jnp.asarray(v) for k, v in arrays.items() if k.startswith("model/")}


def case_inputs(meta_case: dict, arrays: dict[str, np.ndarray], mode: str) -> rtc.RtcInputs:
    """The case's per-row `RtcInputs` (schedule and beta from meta.json, d and s from the arrays)."""
    c = meta_case["name"]
    return rtc.make_inputs(arrays[f"{c}/a_prev"], arrays[f"{c}/d"], arrays[f"{c}/s"], schedule=meta_case["schedule"],
                           max_guidance=meta_case["max_guidance_weight"], mode=mode)


def run_case(meta_case: dict, arrays: dict[str, np.ndarray], mode: str, trace: bool = True):
    """Our sampler on one case: actions [B, Ha, Ad] (and the per-step dict with `trace`)."""
    c = meta_case["name"]
    inputs = case_inputs(meta_case, arrays, mode)
    return _sample(_model_arrays(arrays), jnp.asarray(arrays[f"{c}/obs"]), jnp.asarray(arrays[f"{c}/noise"]), inputs,
                   meta_case["num_steps"], trace)


def plain_euler(meta_case: dict, arrays: dict[str, np.ndarray]) -> jax.Array:
    c = meta_case["name"]
    return _euler(_model_arrays(arrays), jnp.asarray(arrays[f"{c}/obs"]), jnp.asarray(arrays[f"{c}/noise"]),
                  meta_case["num_steps"])


def _compare_run(chk: Checker, c: str, ref: str, actions, steps, v_sign: float, arrays) -> None:
    p = f"{c}/{ref}"
    chk.close(f"{p}/actions", actions, arrays[f"{p}/actions"])
    x_all = np.concatenate([np.asarray(steps["x"]), np.asarray(actions)[None]], axis=0)
    chk.close(f"{p}/x", x_all, arrays[f"{p}/x"])
    chk.close(f"{p}/v", v_sign * np.asarray(steps["v"]), arrays[f"{p}/v"])
    for name in ("x1hat", "err", "correction"):
        chk.close(f"{p}/{name}", steps[name], arrays[f"{p}/{name}"])
    w = np.asarray(steps["weight"])  # [N, B]: one beta per case, so every row has the reference's weight
    chk.close(f"{p}/weight", w, np.broadcast_to(arrays[f"{p}/guidance_weight"][:, None], w.shape))


def _relations(chk: Checker, meta_case: dict, arrays, euler) -> None:
    """Rows that guide nothing (beta = 0, zeros schedule with d = 0, mode off) beside guided rows: plain Euler exactly."""
    c, b = meta_case["name"], arrays[f"{meta_case['name']}/noise"].shape[0]
    base = case_inputs(meta_case, arrays, "guided")
    beta = np.asarray(base.max_guidance).copy()
    sched, d, mode = (np.asarray(x).copy() for x in (base.schedule, base.delay, base.mode))
    beta[0] = 0.0  # row 0: beta = 0
    if b > 1:
        sched[1], d[1] = rtc.SCHEDULES.index("zeros"), 0  # row 1: all-zero prefix weights
    if b > 2:
        mode[2] = rtc.OFF  # row 2: RTC off
    mixed = rtc.RtcInputs(prev_chunk=base.prev_chunk, delay=d, horizon=base.horizon, schedule=sched,
                          max_guidance=beta, mode=mode)
    got = np.asarray(_sample(_model_arrays(arrays), jnp.asarray(arrays[f"{c}/obs"]), jnp.asarray(arrays[f"{c}/noise"]),
                             mixed, meta_case["num_steps"], False))
    chk.exact(f"{c}/relations/inactive_rows_equal_plain_euler", got[: min(b, 3)], np.asarray(euler)[: min(b, 3)])


def run_fixture(path: Path) -> list[Row]:
    """Every case of the fixture: one `Row` per compared quantity."""
    meta, arrays = load(path)
    chk = Checker(_tolerance)
    for mc in meta["cases"]:
        c = mc["name"]
        inputs = case_inputs(mc, arrays, "guided")
        w = np.asarray(rtc.prefix_weights(jnp.asarray(inputs.delay), jnp.asarray(inputs.horizon),
                                          jnp.asarray(inputs.schedule), arrays[f"{c}/a_prev"].shape[1]))
        chk.close(f"{c}/kinetix/prefix_weights", w, arrays[f"{c}/prefix_weights_kinetix"])
        chk.close(f"{c}/lerobot/prefix_weights", w, arrays[f"{c}/prefix_weights_lerobot"])
        exact, steps = run_case(mc, arrays, "guided")
        _compare_run(chk, c, "kinetix", exact, steps, -1.0, arrays)
        sg, steps_sg = run_case(mc, arrays, "stop_gradient")
        _compare_run(chk, c, "kinetix_sg", sg, steps_sg, -1.0, arrays)
        _compare_run(chk, c, "lerobot", sg, steps_sg, 1.0, arrays)
        euler = plain_euler(mc, arrays)
        chk.close(f"{c}/euler_kinetix/actions", euler, arrays[f"{c}/euler_kinetix/actions"])
        chk.close(f"{c}/euler_lerobot/actions", euler, arrays[f"{c}/euler_lerobot/actions"])
        _relations(chk, mc, arrays, euler)
    return chk.rows


def main(argv: list[str]) -> int:
    """Prints the table and the summary; exit status 1 on any FAIL."""
    from eval.parity.checks import report

    rows = run_fixture(Path(argv[0]))
    return report(rows)
