"""The roofline report: measured components against their limits, the chart, and predictions for other devices.

For each component: achieved time t, the limit max(FLOPs / peak, bytes / bandwidth) from the cost model
(`roofline_cost`) and the peaks measured in the same run (`roofline_peaks`), the fraction of the limit
reached (limit / t: 1 is at the limit), and which bound applies. Predictions use the datasheet peaks: a
frame of sequential parts takes at least the sum of their limits.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from eval.bench import roofline_cost as rc
from eval.bench.roofline_peaks import DATASHEETS, Device, Peaks


@dataclasses.dataclass(frozen=True)
class Row:
    """One component of the measured run."""

    name: str
    cost: rc.Cost
    ms: float  # measured, median
    compile_s: float
    limit_ms: float
    bound: str

    @property
    def fraction(self) -> float:
        """Limit / measured time: the share of the device's limit the component reaches."""
        return self.limit_ms / self.ms if self.ms else math.nan

    def to_json(self) -> dict:
        return {"name": self.name, **self.cost.to_json(), "ms": self.ms, "compile_s": self.compile_s,
                "limit_ms": self.limit_ms, "bound": self.bound, "fraction_of_limit": self.fraction,
                "intensity": self.cost.intensity, "achieved_flops": self.cost.flops / (self.ms * 1e-3),
                "achieved_bytes_per_s": self.cost.bytes / (self.ms * 1e-3)}


def rows(costs: dict[str, rc.Cost], times_ms: dict[str, float], compile_s: dict[str, float], peaks: Peaks) -> list[Row]:
    """A `Row` per component measured (costs without a time are left out)."""
    out = []
    for name, cost in costs.items():
        if name in times_ms:
            limit = cost.limit_s(peaks.matmul_flops, peaks.bandwidth) * 1e3
            out.append(Row(name, cost, times_ms[name], compile_s.get(name, math.nan), limit,
                           cost.bound(peaks.matmul_flops, peaks.bandwidth)))
    return out


# --------------------------------------------------------------------------------------------------
# Predictions


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The paper's workload on one model: P, images, Ha, S, N, k, Ns."""

    prefix_len: int
    images: int
    horizon: int
    steps: int | None
    decode_len: int  # N tokens per request, one request per frame
    tokens_per_frame: int  # k
    slots: int  # Ns = ceil((N - 1) / k), the steady pool of one arrival per frame
    image_size: int | None = None

    @property
    def capacity(self) -> int:
        return self.prefix_len + self.decode_len

    def plan(self) -> rc.FramePlan:
        return rc.FramePlan(prefix_len=self.prefix_len, images=self.images, horizon=self.horizon, steps=self.steps,
                            slots=self.slots, capacity=self.capacity, tokens_per_frame=self.tokens_per_frame,
                            image_size=self.image_size)


def _sum_limits(parts: dict[str, rc.Cost], flops: float, bandwidth: float) -> float:
    return sum(c.limit_s(flops, bandwidth) for c in parts.values())


def predict(m: rc.Model, w: Workload, prec: rc.Precision, device: Device) -> dict:
    """Roofline predictions of a continuous frame (and isolated execution) on `device` (bf16 peak).

    Continuous: prefix pass, every head, one admission, k decode steps of Ns slots, each part at its own
    limit. Isolated: two prefix passes (actions, text), every head, one admission and N - 1 batch-1 steps.
    Action Hz counts the first head's chunk (a fixed horizon, or the workload's Ha); tokens/s N per frame.
    """
    flops, bw = device.bf16_flops, device.bandwidth
    parts = rc.frame_parts(m, w.plan(), prec)
    parts.pop("prefix")  # as its two parts, each at its own limit
    parts = {"vision": rc.vision(m, w.images, prec, w.image_size), "backbone": rc.prefill(m, w.prefix_len, prec), **parts}
    frame_s = _sum_limits(parts, flops, bw)
    iso = dict(parts)
    iso.pop("decode", None)
    iso["text prefix"] = rc.prefix_pass(m, w.prefix_len, w.images, prec, image_size=w.image_size)
    iso["text decode"] = rc.decode_step(m, 1, w.capacity, prec).times(w.decode_len - 1)
    iso_s = _sum_limits(iso, flops, bw)
    ha = (m.spec.heads[0].horizon or w.horizon) if m.spec.heads else 0  # the first head's chunk: what a robot runs
    return {
        "device": device.name, "frame_ms": frame_s * 1e3, "horizon": ha, "action_hz": ha / frame_s,
        "tokens_per_s": w.decode_len / frame_s, "isolated_ms": iso_s * 1e3, "ideal_speedup": iso_s / frame_s,
        "parts_ms": {k: c.limit_s(flops, bw) * 1e3 for k, c in parts.items()},
        "bounds": {k: c.bound(flops, bw) for k, c in parts.items()},
    }


def predictions(m: rc.Model, w: Workload, prec: rc.Precision) -> list[dict]:
    return [predict(m, w, prec, d) for d in DATASHEETS]


# --------------------------------------------------------------------------------------------------
# Markdown and the chart


def _f(x: float, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:,.0f}"


def component_table(table: list[Row]) -> list[str]:
    lines = ["| component | measured ms | limit ms | fraction of limit | bound | GFLOP | MB weights | MB K/V r+w | "
             "MB acts | FLOP/byte | achieved GFLOP/s | achieved GB/s | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        c = r.cost
        lines.append(f"| {r.name} | {_f(r.ms)} | {_f(r.limit_ms)} | {r.fraction:.2f} | {r.bound} | {_f(c.flops / 1e9)} | "
                     f"{_f(c.weights / 1e6)} | {_f((c.kv_read + c.kv_write) / 1e6)} | {_f(c.acts / 1e6)} | "
                     f"{_f(c.intensity)} | {_f(c.flops / r.ms / 1e6)} | {_f(c.bytes / r.ms / 1e6)} | {_f(r.compile_s)} |")
    return lines


def peaks_lines(p: Peaks) -> list[str]:
    sizes = ", ".join(f"{n}²: {v / 1e9:.1f}" for n, v in p.matmul_by_size.items())
    return [f"- matmul ({p.dtype}): {p.matmul_flops / 1e9:.1f} GFLOP/s (by size, GFLOP/s: {sizes})",
            f"- streaming, GB/s: sum {p.sum_bandwidth / 1e9:.1f}, gemv {p.gemv_bandwidth / 1e9:.1f}, copy (read + write) "
            f"{p.copy_bandwidth / 1e9:.1f} (arrays of {p.probe_bytes >> 20} MiB); the roofline uses the best read "
            f"stream, {p.bandwidth / 1e9:.1f} GB/s",
            f"- ridge point: {p.matmul_flops / p.bandwidth:.1f} FLOP/byte; load when measured "
            f"{', '.join(f'{x:.2f}' for x in p.loadavg)}"]


def prediction_table(preds: list[dict]) -> list[str]:
    ha = preds[0]["horizon"] if preds else 0
    lines = [f"| device | continuous frame ms | action Hz (first head, Ha = {ha}) | tokens/s | isolated frame ms | "
             "ideal speedup | bound parts |", "|---|---|---|---|---|---|---|"]
    for p in preds:
        bounds = ", ".join(f"{k} {v[0]}" for k, v in p["bounds"].items())
        lines.append(f"| {p['device']} | {p['frame_ms']:.1f} | {p['action_hz']:.0f} | {p['tokens_per_s']:.0f} | "
                     f"{p['isolated_ms']:.1f} | {p['ideal_speedup']:.2f} | {bounds} |")
    return lines


def datasheet_lines() -> list[str]:
    lines = ["| device | BF16 TFLOP/s (dense) | FP32 TFLOP/s | GB/s | GB | source |", "|---|---|---|---|---|---|"]
    for d in DATASHEETS:
        fp32 = "–" if d.fp32_flops is None else f"{d.fp32_flops / 1e12:.1f}"
        lines.append(f"| {d.name} | {d.bf16_flops / 1e12:.1f} | {fp32} | {d.bandwidth / 1e9:,.0f} | {d.memory_gb:g} | "
                     f"{d.source} |")
    return lines


def plot(table: list[Row], peaks: Peaks, path: Path, title: str) -> None:
    """Roofline chart (achieved FLOP/s against intensity, under the measured roof) beside a bar per component
    (the fraction of its limit reached)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    xs = [r.cost.intensity for r in table]
    lo, hi = min(xs + [0.1]) / 3, max(xs + [peaks.matmul_flops / peaks.bandwidth]) * 3
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peaks.matmul_flops, x * peaks.bandwidth) / 1e9 for x in grid], "k-", lw=1.5,
            label=f"roof: {peaks.matmul_flops / 1e9:.0f} GFLOP/s, {peaks.bandwidth / 1e9:.1f} GB/s")
    for r in table:
        y = r.cost.flops / (r.ms * 1e-3) / 1e9
        ax.plot(r.cost.intensity, y, "o", color="tab:blue" if r.bound == "memory" else "tab:red")
        ax.annotate(r.name, (r.cost.intensity, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="FLOP / byte", ylabel="achieved GFLOP/s", title=title)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    names = [r.name for r in table][::-1]
    fr = [r.fraction for r in table][::-1]
    bx.barh(names, fr, color=["tab:blue" if r.bound == "memory" else "tab:red" for r in table][::-1])
    bx.axvline(1.0, color="k", lw=1)
    bx.axvline(0.7, color="gray", lw=1, ls="--")
    bx.set(xlabel="fraction of the limit (limit / measured); blue memory-bound, red compute-bound",
           title="each component against max(FLOPs / peak, bytes / bandwidth)")
    bx.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
