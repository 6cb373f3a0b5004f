"""Metrics over per-frame and per-request records (pure functions, no JAX).

Records are plain dicts, as written to the result JSON by `eval.bench`:

    frame    {"frame": f, "setting": str, "frame_ms": float, "tokens": int (emitted this frame),
              "batch": int (requests in this frame's decode), "arrivals": int, "decode_steps": int
              (batched decode forwards run this frame), "warmup": bool, "drain": bool (optional)}
    request  {"id": int, "setting": str, "arrival_frame": f, "admit_frame": f | None,
              "finish_frame": f | None (None = still running at the end), "tokens": int, "budget": int}

Rules (the benchmark protocol; docs/benchmarks.md):

* warm-up frames, and requests that arrive in them, are excluded everywhere; so are drain frames
  (run after the measured ones only so that requests arriving in measured frames can finish);
* rates are ratios of sums: action Hz = Ha · n_frames / Σ frame time, tokens/s = Σ tokens / Σ time;
* frames run back to back, so a request's latency in ms is the sum of its setting's frame times from
  its arrival frame to its finishing frame, both included (arrival = the tick of the arrival frame,
  finish = the end of the frame that emitted its last token); in frames it is finish − arrival + 1.

Worked example (Ha = 10): frames of 100, 100, 200 ms with 5, 5, 10 tokens give 10·3/0.4 s = 75 Hz
and 20/0.4 s = 50 tokens/s; a request arriving in frame 1 and finishing in frame 2 took 2 frames and
300 ms.

Ideal frame times come from component times measured alone: T_pre = prefill (SigLIP + VLM),
S·T_d = S denoise steps, t(B) = one decode step at batch B. Token 0 of a request comes from the
prefill logits, so a request of N tokens costs N − 1 decode forwards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from oxygen_jax.runtime.frame import BENCH_SETTINGS as SETTINGS
"""`actions_only` is a reference, not a setting of the paper: prefill + denoise, no language."""


# --- frame statistics ----------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (linear interpolation between order statistics); NaN for no values."""
    arr = np.asarray(list(values), np.float64)
    if arr.size == 0:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    return float(np.percentile(arr, q))


def _excluded(frame: Mapping) -> bool:
    return bool(frame.get("warmup", False) or frame.get("drain", False))


def measured(frames: Iterable[Mapping]) -> list[Mapping]:
    """The frames that count: warm-up and drain frames dropped."""
    return [f for f in frames if not _excluded(f)]


def frame_latency(frames: Iterable[Mapping]) -> dict[str, float]:
    """Frame-time statistics in ms over measured frames: n, mean, median, p90, p95, p99, min, max."""
    ms = [float(f["frame_ms"]) for f in measured(frames)]
    if not ms:
        return {"n": 0, **{k: math.nan for k in ("mean", "median", "p90", "p95", "p99", "min", "max")}}
    return {
        "n": len(ms), "mean": float(np.mean(ms)), "median": percentile(ms, 50), "p90": percentile(ms, 90),
        "p95": percentile(ms, 95), "p99": percentile(ms, 99), "min": min(ms), "max": max(ms),
    }


def _total_s(frames: Sequence[Mapping]) -> float:
    return sum(float(f["frame_ms"]) for f in frames) / 1e3


def action_hz(frames: Iterable[Mapping], action_horizon: int) -> float:
    """Actions per second: Ha · n_frames / Σ frame time (= Ha / mean frame time)."""
    m = measured(frames)
    total = _total_s(m)
    return action_horizon * len(m) / total if total > 0 else math.nan


def tokens_per_s(frames: Iterable[Mapping]) -> float:
    """Language tokens per second: Σ tokens / Σ frame time over measured frames."""
    m = measured(frames)
    total = _total_s(m)
    return sum(int(f["tokens"]) for f in m) / total if total > 0 else math.nan


def tokens_per_frame(frames: Iterable[Mapping]) -> float:
    m = measured(frames)
    return sum(int(f["tokens"]) for f in m) / len(m) if m else math.nan


def average_batch(frames: Iterable[Mapping]) -> float:
    """Mean number of requests in a frame's decode work, over measured frames (empty frames count as 0)."""
    m = measured(frames)
    return float(np.mean([int(f["batch"]) for f in m])) if m else math.nan


def speedup(reference: Iterable[Mapping], frames: Iterable[Mapping]) -> float:
    """Mean reference frame time / mean frame time (the action-Hz ratio) over measured frames."""
    ref, cur = frame_latency(reference)["mean"], frame_latency(frames)["mean"]
    return ref / cur if cur > 0 else math.nan


# --- request latency -----------------------------------------------------------------------------


def request_latencies(requests: Iterable[Mapping], frames: Iterable[Mapping]) -> list[dict]:
    """Finished requests that arrived in a measured frame, with `latency_frames` and `latency_ms` added.

    `frames` are the frame records of the same setting, warm-up and drain frames included (every
    frame between a request's arrival and its finish must be present).
    """
    frames = list(frames)
    ms = {int(f["frame"]): float(f["frame_ms"]) for f in frames}
    warm = {int(f["frame"]) for f in frames if _excluded(f)}
    out = []
    for r in requests:
        a, fin = int(r["arrival_frame"]), r.get("finish_frame")
        if a in warm or a not in ms or fin is None:
            continue
        fin = int(fin)
        if fin < a:
            raise ValueError(f"request {r.get('id')}: finish frame {fin} precedes arrival frame {a}")
        missing = [f for f in range(a, fin + 1) if f not in ms]
        if missing:
            raise ValueError(f"request {r.get('id')}: no frame records for frames {missing[:5]}")
        out.append({**r, "latency_frames": fin - a + 1, "latency_ms": sum(ms[f] for f in range(a, fin + 1))})
    return out


def request_latency(requests: Iterable[Mapping], frames: Iterable[Mapping]) -> dict[str, float]:
    """Latency statistics of requests arriving in measured frames: counts, frames and ms (mean, median, p90, p99).

    `unfinished` counts such requests still running (or queued) when the run ended.
    """
    requests, frames = list(requests), list(frames)
    warm = {int(f["frame"]) for f in frames if _excluded(f)}
    eligible = [r for r in requests if int(r["arrival_frame"]) not in warm]
    done = request_latencies(eligible, frames)
    lf = [r["latency_frames"] for r in done]
    lm = [r["latency_ms"] for r in done]
    return {
        "n": len(done), "unfinished": len(eligible) - len(done),
        "frames_mean": float(np.mean(lf)) if lf else math.nan, "frames_median": percentile(lf, 50),
        "frames_max": float(max(lf)) if lf else math.nan,
        "ms_mean": float(np.mean(lm)) if lm else math.nan, "ms_median": percentile(lm, 50),
        "ms_p90": percentile(lm, 90), "ms_p99": percentile(lm, 99),
    }


# --- component times and ideal frames ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Components:
    """Warm component times in ms, each measured alone (median of several runs).

    Attributes:
      prefill_ms: T_pre, SigLIP + VLM prefill of one observation.
      denoise_ms: {S: time of S denoise steps}; other S are scaled from the mean per-step time.
      decode_step_ms: {B: one decode step with B active requests}; other B are interpolated linearly
        (and extrapolated from the two largest B measured).
      adapter_step_ms: {B: one decode step with a language-adapter bank, every slot on adapter 1}
        (only with `eval.bench --adapter-rank`).
      mixed_step_ms: {B: the same with half the slots on the adapter and half on the base weights}.
      heads_ms: {head name: its prepare + denoise on a shared prefix} for models with several action
        heads (`eval.bench --heads`; `prefill_ms` is then their one prefix pass and `denoise_ms` empty).
    """

    prefill_ms: float
    denoise_ms: Mapping[int, float]
    decode_step_ms: Mapping[int, float]
    adapter_step_ms: Mapping[int, float] = dataclasses.field(default_factory=dict)
    mixed_step_ms: Mapping[int, float] = dataclasses.field(default_factory=dict)
    heads_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def actions(self, setting: str, num_steps: int) -> float:
        """The action part of a frame: T_pre + S·T_d, or with several heads T_pre + Σ_h T_h (one shared
        prefix pass) and, for isolated, Σ_h (T_pre + T_h) (each head its own prefix pass); parallel: the
        longest single-head program, max_h (T_pre + T_h)."""
        if not self.heads_ms:
            return self.prefill_ms + self.denoise(num_steps)
        if setting == "isolated":
            return sum(self.prefill_ms + t for t in self.heads_ms.values())
        if setting == "parallel":
            return max(self.prefill_ms + t for t in self.heads_ms.values())
        return self.prefill_ms + sum(self.heads_ms.values())

    def denoise(self, num_steps: int) -> float:
        if num_steps in self.denoise_ms:
            return float(self.denoise_ms[num_steps])
        if not self.denoise_ms:
            raise ValueError("no denoise times measured")
        per_step = np.mean([ms / s for s, ms in self.denoise_ms.items()])
        return float(per_step * num_steps)

    def denoise_step(self) -> float:
        """T_d: mean time per denoise step over the measured S."""
        return float(np.mean([ms / s for s, ms in self.denoise_ms.items()]))

    def decode_step(self, batch: float) -> float:
        """t(B) for any B >= 1 (t(0) = 0: nothing to decode)."""
        if batch <= 0:
            return 0.0
        if not self.decode_step_ms:
            raise ValueError("no decode-step times measured")
        bs = sorted(self.decode_step_ms)
        ts = [float(self.decode_step_ms[b]) for b in bs]
        if batch <= bs[-1] or len(bs) == 1:
            return float(np.interp(batch, bs, ts))
        slope = (ts[-1] - ts[-2]) / (bs[-1] - bs[-2])
        return ts[-1] + max(slope, 0.0) * (batch - bs[-1])

    def to_json(self) -> dict:
        return {
            "prefill_ms": self.prefill_ms,
            "denoise_ms": {str(k): v for k, v in sorted(self.denoise_ms.items())},
            "decode_step_ms": {str(k): v for k, v in sorted(self.decode_step_ms.items())},
            **({"adapter_step_ms": {str(k): v for k, v in sorted(self.adapter_step_ms.items())},
                "mixed_step_ms": {str(k): v for k, v in sorted(self.mixed_step_ms.items())}}
               if self.adapter_step_ms else {}),
            **({"heads_ms": dict(self.heads_ms)} if self.heads_ms else {}),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "Components":
        return cls(
            prefill_ms=float(d["prefill_ms"]),
            denoise_ms={int(k): float(v) for k, v in d["denoise_ms"].items()},
            decode_step_ms={int(k): float(v) for k, v in d["decode_step_ms"].items()},
            adapter_step_ms={int(k): float(v) for k, v in d.get("adapter_step_ms", {}).items()},
            mixed_step_ms={int(k): float(v) for k, v in d.get("mixed_step_ms", {}).items()},
            heads_ms={str(k): float(v) for k, v in d.get("heads_ms", {}).items()},
        )


def _check_setting(setting: str) -> None:
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; choose one of {SETTINGS}")


def ideal_frame_ms(
    setting: str, comp: Components, *, num_steps: int, arrivals: int, decode_steps: int, batch: float
) -> float:
    """The ideal time of one frame from component times, given the frame's actual work.

        isolated    T_pre + S·T_d  [+ T_pre + steps·t(B) when requests arrived]
        shared_kv   T_pre + S·T_d  + steps·t(B)
        continuous  T_pre + S·T_d  + steps·t(B)      (steps <= k, B = active requests)
        parallel    max(T_pre + S·T_d, T_pre + steps·t(B)), a lower bound (no contention)
        actions_only T_pre + S·T_d

    With several heads (`Components.heads_ms`) T_pre + S·T_d is replaced by `Components.actions`.

    Args:
      arrivals: requests arriving this frame (isolated and parallel run a text prefill only then).
      decode_steps: batched decode forwards run this frame.
      batch: requests in those forwards.
    """
    _check_setting(setting)
    act = comp.actions(setting, num_steps)
    text = decode_steps * comp.decode_step(batch) if decode_steps > 0 else 0.0
    if setting == "actions_only":
        return act
    if setting in ("shared_kv", "continuous"):
        return act + text
    if arrivals <= 0:
        return act
    if setting == "isolated":
        return act + comp.prefill_ms + text
    return max(act, comp.prefill_ms + text)


def ideal_mean_frame_ms(setting: str, comp: Components, frames: Iterable[Mapping], *, num_steps: int) -> float:
    """Mean of `ideal_frame_ms` over the measured frames (each with its own arrivals, steps and batch)."""
    m = measured(frames)
    if not m:
        return math.nan
    return float(np.mean([
        ideal_frame_ms(setting, comp, num_steps=num_steps, arrivals=int(f["arrivals"]),
                       decode_steps=int(f["decode_steps"]), batch=float(f["batch"]))
        for f in m
    ]))


def steady_state_batch(decode_len: int, tokens_per_frame: int, arrivals_per_frame: float) -> float:
    """B*: requests active in a continuous-batching burst in steady state.

    A request of N tokens takes token 0 from the prefill and then k per frame, so it is in
    ceil((N − 1)/k) bursts; with λ arrivals per frame B* = λ·ceil((N − 1)/k) (= λ·N/k when k | N, k > 1).
    """
    return arrivals_per_frame * math.ceil(max(decode_len - 1, 0) / tokens_per_frame)


def steady_state_ideal_ms(
    setting: str, comp: Components, *, num_steps: int, decode_len: int, tokens_per_frame: int = 1,
    arrivals_per_frame: float = 1.0,
) -> float:
    """Closed-form ideal frame time for one arrival per frame (λ scales the text share).

        isolated    2·T_pre + S·T_d + (N − 1)·t(1)
        shared_kv   T_pre + S·T_d + (N − 1)·t(1)
        continuous  T_pre + S·T_d + k·t(B*)
        parallel    max(T_pre + S·T_d, T_pre + (N − 1)·t(1))

    For λ != 1 the settings without batching across frames batch a frame's arrivals together:
    (N − 1)·t(λ) per frame for λ >= 1, λ·(N − 1)·t(1) on average for λ < 1 (and isolated then pays
    its text prefill in a fraction λ of the frames).
    """
    _check_setting(setting)
    act = comp.actions(setting, num_steps)
    if arrivals_per_frame <= 0:
        return act
    if setting == "continuous":
        b = steady_state_batch(decode_len, tokens_per_frame, arrivals_per_frame)
        steps = min(tokens_per_frame, max(decode_len - 1, 0))
        return act + (steps * comp.decode_step(b) if b > 0 else 0.0)
    lam = arrivals_per_frame
    text = (decode_len - 1) * (comp.decode_step(lam) if lam >= 1 else lam * comp.decode_step(1))
    if setting == "shared_kv":
        return act + text
    if setting == "isolated":
        return act + min(lam, 1.0) * comp.prefill_ms + text
    return max(act, comp.prefill_ms + text)


# --- one setting's summary -----------------------------------------------------------------------


def summarize(
    frames: Sequence[Mapping], requests: Sequence[Mapping], *, action_horizon: int,
    comp: Components | None = None, setting: str | None = None, num_steps: int | None = None,
) -> dict[str, float]:
    """The metrics of one setting at one grid point (flat dict, JSON-ready).

    With `comp`, `setting` and `num_steps` also `ideal_frame_ms` and `achieved_fraction`
    (ideal / measured mean frame time: 1 = the frame is as fast as its components alone).
    """
    lat = frame_latency(frames)
    req = request_latency(requests, frames)
    out = {
        "frames_measured": lat["n"],
        "frame_ms_mean": lat["mean"], "frame_ms_median": lat["median"], "frame_ms_p90": lat["p90"],
        "frame_ms_p95": lat["p95"], "frame_ms_p99": lat["p99"], "frame_ms_min": lat["min"], "frame_ms_max": lat["max"],
        "action_hz": action_hz(frames, action_horizon), "tokens_per_s": tokens_per_s(frames),
        "tokens_per_frame": tokens_per_frame(frames), "avg_batch": average_batch(frames),
        "requests_measured": req["n"], "requests_unfinished": req["unfinished"],
        "request_latency_frames_mean": req["frames_mean"], "request_latency_frames_median": req["frames_median"],
        "request_latency_frames_max": req["frames_max"],
        "request_latency_ms_mean": req["ms_mean"], "request_latency_ms_median": req["ms_median"],
        "request_latency_ms_p90": req["ms_p90"], "request_latency_ms_p99": req["ms_p99"],
    }
    if comp is not None and setting is not None and num_steps is not None:
        ideal = ideal_mean_frame_ms(setting, comp, frames, num_steps=num_steps)
        out["ideal_frame_ms"] = ideal
        out["achieved_fraction"] = ideal / lat["mean"] if lat["n"] else math.nan
    return out
