"""The spread of a bench figure over its measured frames, and rounding a figure to what that spread supports.

`eval.bench.report` prints each frame time as its median with the interquartile range (p25-p75) over the measured
frames, and each speedup as the ratio of mean frame times with the IQR of the per-frame ratios (isolated
frame f / this setting's frame f: the settings run the same frames interleaved, so frame f of each saw the
same inputs and nearly the same machine). Every figure is rounded so that the last digit shown is the
leading digit of its spread (`decimals`), e.g.

    median 2.347 ms, IQR 2.118-2.431 (width 0.313)   ->  "2.3 (2.1–2.4)"
    median 2,334 ms, IQR 2,210-2,400 (width 190)     ->  "2,300 (2,200–2,400)"
    speedup 1.2139, per-frame IQR 1.187-1.262        ->  "1.21 (1.19–1.26)"

A record whose run file is missing falls back to the min-max of its frames (summary.json keeps those).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def decimals(width: float | None) -> int | None:
    """Digits after the point that keep `width`'s leading digit and no more (negative: tens, hundreds, ...).

    0.313 -> 1, 0.034 -> 2, 1.9 -> 0, 190 -> -2; None when the width is missing, zero or not finite.
    """
    if width is None or not math.isfinite(width) or width <= 0:
        return None
    return -math.floor(math.log10(width))


def fmt(x: float | None, digits: int | None, default: int = 2) -> str:
    """`x` rounded to `digits` decimals (negative: to tens, hundreds), thousands separated; '–' when missing."""
    if x is None or not math.isfinite(x):
        return "–"
    d = default if digits is None else digits
    if d <= 0:
        return f"{round(x, d):,.0f}"
    return f"{x:,.{d}f}"


def with_spread(value: float | None, lo: float | None, hi: float | None, default: int = 2) -> str:
    """'value (lo–hi)', all rounded to the spread's leading digit (`default` decimals without a spread)."""
    d = None if value is None or lo is None or hi is None else decimals(hi - lo)
    if d is None:  # no figure, or no spread (one frame, or a figure that is the same in every frame, e.g. isolated / isolated)
        return fmt(value, None, default)
    return f"{fmt(value, d, default)} ({fmt(lo, d, default)}–{fmt(hi, d, default)})"


def rounded(value: float | None, relative_width: float | None, default: int = 2) -> str:
    """`value` rounded to a spread of `relative_width` x value (a rate that scales with the frame time)."""
    if value is None or relative_width is None or not math.isfinite(value):
        return fmt(value, None, default)
    return fmt(value, decimals(abs(value) * relative_width), default)


def _quartiles(values: Sequence[float]) -> tuple[float, float, float] | None:
    if not values:
        return None
    p25, p50, p75 = np.percentile(np.asarray(values, np.float64), [25, 50, 75])
    return float(p25), float(p50), float(p75)


def _measured(frames: Sequence[Mapping], record: Mapping) -> dict[int, float]:
    """{frame index: ms} of the record's runner (setting, k, with or without an adapter), measured frames only."""
    adapter = bool(record.get("adapter_share"))
    return {int(f["frame"]): float(f["frame_ms"]) for f in frames
            if f["setting"] == record["setting"] and f.get("k") == record.get("k")
            and ("adapter" in f.get("label", "")) == adapter and not f.get("warmup") and not f.get("drain")}


def annotate(summary: Sequence[Mapping], runs: Mapping[str, Mapping]) -> list[dict]:
    """Copies of the summary records with their spreads added.

    Added keys: `frame_ms_lo` / `frame_ms_hi` (p25 / p75 of the measured frames, or min / max without a run
    file), `spread` ("IQR" or "min–max"), `frame_rel_width` ((hi - lo) / median: rates that scale with
    1 / frame time are rounded with it), `speedup_lo` / `speedup_hi` (IQR of the per-frame ratios to the
    isolated setting's frames; absent without isolated frames).

    Args:
      summary: summary.json's records.
      runs: {"runs/<group>.json": that run file's contents} (a record names its own in `run_file`).
    """
    out = []
    for r in summary:
        r = dict(r)
        frames = (runs.get(r.get("run_file", "")) or {}).get("frames") or []
        mine = _measured(frames, r)
        q = _quartiles(list(mine.values()))
        if q is not None:
            r["frame_ms_lo"], r["frame_ms_hi"], r["spread"] = q[0], q[2], "IQR"
        elif r.get("frame_ms_min") is not None and r.get("frame_ms_max") is not None:
            r["frame_ms_lo"], r["frame_ms_hi"], r["spread"] = r["frame_ms_min"], r["frame_ms_max"], "min–max"
        med = r.get("frame_ms_median")
        if r.get("frame_ms_lo") is not None and med:
            r["frame_rel_width"] = (r["frame_ms_hi"] - r["frame_ms_lo"]) / med
        iso = _measured(frames, {"setting": "isolated", "k": None})
        ratios = [iso[f] / ms for f, ms in mine.items() if f in iso and ms > 0]
        q = _quartiles(ratios)
        if q is not None:
            r["speedup_lo"], r["speedup_hi"] = q[0], q[2]
        out.append(r)
    return out
