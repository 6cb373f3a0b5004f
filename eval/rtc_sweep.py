"""Closed-loop delay sweep for real-time chunking on a small simulated task where timing matters.

    python -m eval.rtc_sweep --out eval/results/rtc_sweep

The task, "two gaps" (numpy, vectorised over episodes). A point mass with first-order velocity lag
(v <- v + 0.5 (a - v), p <- p + v; the action a is a commanded velocity) starts at (0, 0) and must reach
(1, 0) within 80 control steps. On the way, a wall at x in [0.45, 0.55] has two gaps, centred at y = +-0.25
with half-width 0.07; touching the wall fails the episode. The scripted expert picks a gap at random for each
episode and flies through it at 0.025 per step (about 47 steps), so at the start the demonstrations are
bimodal: the same state leads up or down. Timing matters twice. First, the lag carries a stale command
forward. Second, a chunk computed from an observation d steps old assumes its own first d actions were
executed, but the robot executed the previous chunk's. A chunk that picks the other gap, or that does not
continue the executed motion, jumps at the boundary and can steer into the wall. The paper's Kinetix
tasks have the same two ingredients (arXiv 2506.07339); this task is a stand-in because kinetix-env was
not installed here.

The policy is a small flow-matching MLP, v(x [Ha, Ad], per-token time [Ha], observation (p, v)), Ha = 8,
Ad = 2. It is trained on the expert's chunks and sampled through our action path: `runtime.rtc.integrate`,
the Euler loop with guidance and prefix inpainting that π0.5 and the heads use, 5 flow steps. A second copy
is trained with training-time RTC: `training.flow.rtc.token_time`, d uniform in [0, 4], loss on the postfix only
(`training.flow.rtc.masked_mean`).

Execution (kinetix's eval_flow), execution horizon s = 4, for every d in 0..4 in control steps:

* synchronous: the robot stands still (commands 0) for the d steps of each inference, then executes
  new[0:s];
* naive asynchronous: it executes old[s:s+d] while the next chunk is computed, then new[d:s];
* guided RTC, exact (VJP) and stop-gradient: as naive, with the new chunk guided to old[s:] (schedule exp,
  β = 5);
* training-time RTC: as naive, the trained copy with old[s:s+d] inpainted (mode "trained").

Reported per method and d: the success rate, and the largest command jump at chunk boundaries
(max |a_t - a_{t-1}| at the step where a new chunk's first executed action follows the previous command).
The jump is the per-episode maximum, averaged over episodes. Every method sees the same episodes' noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from oxygen_jax.runtime import rtc
from training.flow import rtc as train_rtc

HA, AD, OBS = 8, 2, 4
SPEED, LAG, T_MAX = 0.025, 0.5, 90
WALLS, GAP_Y, GAP_HALF, MARGIN = ((0.25, 0.32), (0.68, 0.75)), 0.2, 0.06, 0.05
GOAL, GOAL_RADIUS = np.array([1.0, 0.0]), 0.04
SCALE = SPEED  # actions are trained in units of the cruise speed
METHODS = ("synchronous", "naive_async", "rtc_exact", "rtc_stop_gradient", "rtc_trained")
MODE = {"naive_async": "off", "rtc_exact": "guided", "rtc_stop_gradient": "stop_gradient", "rtc_trained": "trained"}


# --------------------------------------------------------------------------------------------------
# The task


def step_env(p, v, a):
    """One control step for every episode: velocity lag, move, wall contact. Returns (p, v, hit bool [N])."""
    v = v + LAG * (a - v)
    p = p + v
    in_wall = np.zeros(len(p), bool)
    for x0, x1 in WALLS:
        in_wall |= (p[:, 0] >= x0) & (p[:, 0] <= x1)
    in_gap = np.abs(np.abs(p[:, 1]) - GAP_Y) <= GAP_HALF
    return p, v, in_wall & ~in_gap


def expert_action(p, gap):
    """Commanded velocity of the scripted expert toward its next waypoint: in front of and behind the gap it chose
    in each wall (gap [N, walls], +1 up, -1 down), then the goal."""
    wx, wy = np.full(len(p), GOAL[0]), np.full(len(p), GOAL[1])
    for k in reversed(range(len(WALLS))):  # the first wall not yet passed wins
        x0, x1 = WALLS[k]
        pending = p[:, 0] < x1 + MARGIN
        wx = np.where(pending, np.where(p[:, 0] < x0 - MARGIN, x0 - MARGIN, x1 + MARGIN), wx)
        wy = np.where(pending, gap[:, k] * GAP_Y, wy)
    d = np.stack([wx - p[:, 0], wy - p[:, 1]], 1)
    n = np.linalg.norm(d, axis=1, keepdims=True)
    speed = np.minimum(SPEED, n)  # slow down onto the goal
    return d / np.maximum(n, 1e-9) * speed


def expert_chunk(p, v, gap):
    """The next Ha expert commands from (p, v) [M, 2] (a rollout of the expert, no pauses): [M, Ha, 2]."""
    out = []
    for _ in range(HA):
        a = expert_action(p, gap)
        out.append(a)
        p, v, _ = step_env(p, v, a)
    return np.stack(out, 1)


def demonstrations(episodes: int, rng: np.random.Generator):
    """(observations [M, 4], chunks [M, Ha, 2]): states visited by the expert with execution noise and random
    stops (so that standing still mid-way, as synchronous execution does, is in the data), each labelled with
    the expert's clean next Ha commands from that state (DART-style)."""
    gap = rng.choice([-1.0, 1.0], (episodes, len(WALLS)))
    p, v = np.zeros((episodes, 2)), np.zeros((episodes, 2))
    pause = np.zeros(episodes, int)
    obs, labels = [], []
    for _ in range(T_MAX):
        obs.append(np.concatenate([p, v], 1))
        labels.append(expert_chunk(p, v, gap))
        pause = np.where(pause > 0, pause - 1, np.where(rng.random(episodes) < 0.04, rng.integers(1, 5, episodes), 0))
        a = expert_action(p, gap) + rng.normal(0.0, 0.2 * SPEED, (episodes, 2))
        p, v, hit = step_env(p, v, np.where(pause[:, None] > 0, 0.0, a))
        assert not hit.any(), "the expert touched the wall"
    obs, labels = np.stack(obs, 1), np.stack(labels, 1)  # [E, T, ...]
    return obs.reshape(-1, OBS).astype(np.float32), (labels / SCALE).reshape(-1, HA, AD).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# The policy: an MLP velocity with per-token time


def init_mlp(key, width: int = 256):
    sizes = [HA * AD + HA + OBS, width, width, width, HA * AD]
    keys = jax.random.split(key, len(sizes) - 1)
    return [(jax.random.normal(k, (i, o)) * math.sqrt(1.0 / i), jnp.zeros(o)) for k, i, o in zip(keys, sizes, sizes[1:])]


def mlp_velocity(params, x, t_tok, obs):
    """v [B, Ha, Ad] at x [B, Ha, Ad], per-token time t_tok [B, Ha] (1 noise -> 0 data), observation [B, 4]."""
    h = jnp.concatenate([x.reshape(x.shape[0], -1), t_tok, obs * jnp.asarray([2.0, 4.0, 40.0, 40.0])], axis=1)
    for w, b in params[:-1]:
        h = jax.nn.gelu(h @ w + b)
    w, b = params[-1]
    return (h @ w + b).reshape(x.shape)


def train(obs, chunks, *, max_delay: int, steps: int, seed: int, batch: int = 512):
    """Flow matching (openpi's convention: x_t = t noise + (1 - t) a, target noise - a). With max_delay > 0,
    training-time RTC: d uniform in [0, max_delay] per example, the first d tokens clean (t = 0), loss on the rest."""
    key = jax.random.key(seed)
    params = init_mlp(key)
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 200, steps, 1e-5), weight_decay=1e-4)
    state = opt.init(params)
    obs, chunks = jnp.asarray(obs), jnp.asarray(chunks)
    cfg = train_rtc.RtcTrainConfig(max_delay=max_delay)

    @jax.jit
    def step(params, state, key):
        k_idx, k_noise, k_t, k_d = jax.random.split(key, 4)
        idx = jax.random.randint(k_idx, (batch,), 0, obs.shape[0])
        a, o = chunks[idx], obs[idx]
        noise = jax.random.normal(k_noise, a.shape)
        t = jax.random.beta(k_t, 1.5, 1.0, (batch,)) * 0.999 + 0.001  # openpi's time distribution
        d = train_rtc.sample_delay(k_d, batch, cfg) if max_delay else jnp.zeros(batch, jnp.int32)
        t_tok = train_rtc.token_time(t, d, HA)

        def loss_fn(p):
            x_t = t_tok[:, :, None] * noise + (1 - t_tok[:, :, None]) * a
            err = jnp.mean(jnp.square(mlp_velocity(p, x_t, t_tok, o) - (noise - a)), axis=-1)
            return train_rtc.masked_mean(err, t_tok > 0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(steps):
        key, sub = jax.random.split(key)
        params, state, loss = step(params, state, sub)
        if i % 500 == 0 or i == steps - 1:
            losses.append((i, float(loss)))
    return params, losses


@functools.partial(jax.jit, static_argnames=("num_steps",))
def sample(params, obs, noise, inputs: rtc.RtcInputs, num_steps: int = 5):
    """One chunk per row through `runtime.rtc.integrate` (per-row mode: off / guided / stop_gradient / trained)."""
    b = noise.shape[0]
    v = lambda x, t: mlp_velocity(params, x, jnp.broadcast_to(t, (b, HA)), obs)  # noqa: E731
    tv = lambda x, t_tok: mlp_velocity(params, x, t_tok, obs)  # noqa: E731
    return rtc.integrate(v, noise, num_steps, -1.0, inputs, t0=1.0, token_velocity=tv)


# --------------------------------------------------------------------------------------------------
# Closed loop


@dataclasses.dataclass
class Episodes:
    p: np.ndarray
    v: np.ndarray
    done: np.ndarray  # reached the goal
    failed: np.ndarray  # touched the wall
    t: int = 0
    last: np.ndarray | None = None  # the command executed last step [N, 2]

    @classmethod
    def start(cls, n: int) -> "Episodes":
        return cls(np.zeros((n, 2)), np.zeros((n, 2)), np.zeros(n, bool), np.zeros(n, bool), 0, np.zeros((n, 2)))

    def execute(self, a: np.ndarray) -> None:
        live = ~(self.done | self.failed) & (self.t < T_MAX)
        p, v, hit = step_env(self.p, self.v, a)
        self.p, self.v = np.where(live[:, None], p, self.p), np.where(live[:, None], v, self.v)
        self.failed |= live & hit
        self.done |= live & ~hit & (np.linalg.norm(self.p - GOAL, axis=1) < GOAL_RADIUS)
        self.last = np.where(live[:, None], a, self.last)
        self.t += 1


def run_method(method: str, d: int, s: int, params, rng: np.random.Generator, n: int, beta: float = 5.0):
    """Success rate and mean per-episode max boundary jump of one method at delay d (control steps)."""
    ep = Episodes.start(n)
    jumps = np.zeros(n)

    def chunk(prev, mode):
        noise = rng.standard_normal((n, HA, AD)).astype(np.float32)
        if prev is None or mode == "off":
            inputs = rtc.off(n, HA, AD)
        else:
            aligned = np.concatenate([prev[:, s:], np.zeros_like(prev[:, :s])], axis=1) / SCALE
            inputs = rtc.make_inputs(aligned, d, s, schedule="exp", max_guidance=beta, mode=mode)
        obs = np.concatenate([ep.p, ep.v], 1).astype(np.float32)
        return np.asarray(sample(params, jnp.asarray(obs), jnp.asarray(noise), inputs), np.float64) * SCALE

    def boundary(a):
        live = ~(ep.done | ep.failed)
        jumps[:] = np.where(live, np.maximum(jumps, np.max(np.abs(a - ep.last), axis=1)), jumps)

    current = chunk(None, "off")  # the first chunk: every method starts from a standstill
    for j in range(s):
        ep.execute(current[:, j])
    while ep.t < T_MAX:
        if method == "synchronous":
            for _ in range(d):
                ep.execute(np.zeros((n, 2)))
            new, start = chunk(None, "off"), 0
        else:
            new = chunk(current, MODE[method])
            for j in range(d):  # the robot keeps executing the previous chunk during inference
                ep.execute(current[:, s + j])
            start = d
        boundary(new[:, start])
        for j in range(start, s):
            ep.execute(new[:, j])
        current = new
    ok = ep.done & ~ep.failed
    return dict(success=float(ok.mean()), max_jump=float(jumps.mean() / SPEED), collisions=float(ep.failed.mean()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("eval/results/rtc_sweep"))
    ap.add_argument("--demos", type=int, default=2000, help="expert episodes for training")
    ap.add_argument("--train-steps", type=int, default=5000)
    ap.add_argument("--episodes", type=int, default=500, help="evaluation episodes per method and delay")
    ap.add_argument("--delays", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--horizon", type=int, default=4, help="execution horizon s")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if max(args.delays) > args.horizon or args.horizon > HA - max(args.delays):
        raise SystemExit(f"need d <= s <= Ha - d for every delay (Ha = {HA}); got s = {args.horizon}, d = {args.delays}")
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    obs, chunks = demonstrations(args.demos, rng)
    base, base_loss = train(obs, chunks, max_delay=0, steps=args.train_steps, seed=args.seed)
    trained, trained_loss = train(obs, chunks, max_delay=max(args.delays), steps=args.train_steps, seed=args.seed + 1)
    train_s = time.perf_counter() - t0
    rows = []
    for d in args.delays:
        for m in METHODS:
            res = run_method(m, d, args.horizon, trained if m == "rtc_trained" else base,
                             np.random.default_rng([args.seed, d]), args.episodes)
            rows.append(dict(method=m, delay=d, **res))
            print(f"d={d} {m:18s} success {res['success']:.3f}  max jump {res['max_jump']:.2f}  "
                  f"collisions {res['collisions']:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m eval.rtc_sweep", *(sys.argv[1:] if argv is None else argv)])
    meta = dict(command=command, args={k: str(v) for k, v in vars(args).items()}, demos_pairs=int(len(obs)),
                train_seconds=round(train_s, 1), loss_base=base_loss, loss_trained=trained_loss,
                total_seconds=round(time.perf_counter() - t0, 1))
    (args.out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    _report(rows, args.delays, args.out)
    return 0


def _report(rows, delays, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["method"], r["delay"]): r for r in rows}
    lines = ["| method | " + " | ".join(f"d = {d}" for d in delays) + " |", "|---|" + "---|" * len(delays)]
    for key, what in (("success", "success"), ("max_jump", "max jump")):
        for m in METHODS:
            cells = [f"{by[m, d][key]:.2f}" for d in delays]
            lines.append(f"| {m} ({what}) | " + " | ".join(cells) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for m in METHODS:
        axes[0].plot(delays, [by[m, d]["success"] for d in delays], marker="o", label=m)
        axes[1].plot(delays, [by[m, d]["max_jump"] for d in delays], marker="o", label=m)
    axes[0].set(xlabel="inference delay d (control steps)", ylabel="success rate", ylim=(-0.02, 1.02))
    axes[1].set(xlabel="inference delay d (control steps)", ylabel="max boundary jump (units of cruise speed)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
