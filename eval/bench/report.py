"""Markdown tables and PNG plots from an `eval.bench` result directory.

    python -m eval.bench.report RESULTS_DIR [--out DIR]

Reads `summary.json` (required), `components.json`, `environment.json` and `runs/*.json`, and writes
into DIR (default RESULTS_DIR):

    report.md               environment, component times, every grid point, ablation, N and k sweeps
    tradeoff.png            language tokens/s against action Hz per setting (the paper's main figure)
    ablation.png            isolated / parallel / shared KV / continuous: frame time and speedup, with ideals
    sweep_N.png             action Hz and tokens/s over the decode length N
    sweep_k.png             continuous batching over tokens per frame k (other settings as lines)
    latency_vs_batch.png    frame time against active requests, and the decode step t(B)
    fanout.png              with several heads (`eval.bench --heads`): each setting's frame against the
                            single-head frames of the same run, and the fan-out ratio

The ablation and the sweeps are drawn at a reference point chosen from what was measured: S = 10,
uniform:1 arrivals, the largest N, and k = 5 when present (otherwise the nearest values).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from eval.bench import spread
from oxygen_jax.runtime.frame import BENCH_SETTINGS

SETTING_ORDER = BENCH_SETTINGS
LABELS = {"isolated": "isolated", "parallel": "parallel", "shared_kv": "shared KV", "continuous": "continuous batching",
          "actions_only": "actions only (reference)"}
COLORS = {"isolated": "#7f7f7f", "parallel": "#ff7f0e", "shared_kv": "#1f77b4", "continuous": "#2ca02c", "actions_only": "#9467bd"}
PLOTS = ("tradeoff.png", "ablation.png", "sweep_N.png", "sweep_k.png", "latency_vs_batch.png")
FANOUT_PLOT = "fanout.png"


# --- loading --------------------------------------------------------------------------------------


def load_results(results_dir: Path) -> dict:
    """{"summary": [...], "components": {...}, "environment": {...}, "runs": [...], "run_files": {...}} from a
    result directory (`run_files`: {"runs/<group>.json": that run}, as summary records name them)."""
    results_dir = Path(results_dir)
    path = results_dir / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `python -m eval.bench --out {results_dir}` first")
    summary = json.loads(path.read_text())
    if not isinstance(summary, list) or not summary:
        raise ValueError(f"{path} holds no records")

    def optional(name):
        p = results_dir / name
        return json.loads(p.read_text()) if p.is_file() else {}

    run_files = {f"runs/{p.name}": json.loads(p.read_text()) for p in sorted((results_dir / "runs").glob("*.json"))}
    return {"summary": summary, "components": optional("components.json"),
            "environment": optional("environment.json"), "runs": list(run_files.values()), "run_files": run_files}


# --- helpers --------------------------------------------------------------------------------------


def _num(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _frame_ms(r: Mapping) -> str:
    """The median frame time with its spread (`spread.annotate`), rounded to the spread's leading digit."""
    return spread.with_spread(r.get("frame_ms_median"), r.get("frame_ms_lo"), r.get("frame_ms_hi"))


def _ms_like_frame(r: Mapping, key: str) -> str:
    """Another ms figure of the same frames (p90, ideal, latency), at the frame spread's decimals."""
    lo, hi = r.get("frame_ms_lo"), r.get("frame_ms_hi")
    return spread.fmt(r.get(key), spread.decimals(hi - lo) if lo is not None and hi is not None else None)


def _rate(r: Mapping, key: str, default: int = 1) -> str:
    """A rate or ratio that scales with 1 / frame time (Hz, tokens/s, achieved), rounded to the frames' spread."""
    return spread.rounded(r.get(key), r.get("frame_rel_width"), default)


def _speedup(r: Mapping) -> str:
    """Ratio of mean frame times to isolated, with the per-frame ratios' IQR."""
    return spread.with_spread(r.get("speedup_vs_isolated"), r.get("speedup_lo"), r.get("speedup_hi"))


def _table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _setting_label(r: Mapping) -> str:
    return LABELS[r["setting"]] + (f" (k={r['k']})" if r.get("k") else "")


def _group_key(r: Mapping) -> tuple:
    return (r["workload"], r["S"], r["N"], r["arrival"])


def _sort_key(r: Mapping) -> tuple:
    return (SETTING_ORDER.index(r["setting"]), r.get("k") or 0)


def reference_point(summary: Sequence[Mapping]) -> dict:
    """The (workload, S, N, arrival, k) the ablation and sweeps are drawn at (see the module docstring)."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in summary:
        groups[_group_key(r)].append(r)

    def score(key):
        recs = groups[key]
        workload, s, n, arrival = key
        return (len({r["setting"] for r in recs}), arrival == "uniform:1", -abs(s - 10), n)

    key = max(groups, key=score)
    ks = sorted({r["k"] for r in groups[key] if r.get("k")})
    k = min(ks, key=lambda v: (abs(v - 5), v)) if ks else None
    return {"workload": key[0], "S": key[1], "N": key[2], "arrival": key[3], "k": k}


def _at(summary, ref) -> list[dict]:
    """Records of the reference grid point (every setting and k)."""
    return [r for r in summary if _group_key(r) == (ref["workload"], ref["S"], ref["N"], ref["arrival"])]


def _n_series(summary, ref) -> list[dict]:
    """Records at the reference workload, S and arrival, any N."""
    return [r for r in summary if (r["workload"], r["S"], r["arrival"]) == (ref["workload"], ref["S"], ref["arrival"])]


def _pick_cb(records: Sequence[Mapping], k) -> list[dict]:
    """Non-batched settings, plus continuous batching at tokens-per-frame k."""
    return [r for r in records if r["setting"] != "continuous" or r.get("k") == k]


# --- markdown -------------------------------------------------------------------------------------


def _environment_md(env: Mapping) -> str:
    if not env:
        return "_environment.json missing_"
    keys = ("preset", "parameters", "dtype", "backend", "device_kind", "device_count", "cpu_model", "cpu_count",
            "loadavg_start", "loadavg_end", "jax", "jaxlib", "commit", "fixed_length_decode", "timestamp", "command")
    def value(k):
        v = env[k]
        if k == "command":
            return f"`{v}`"
        return " / ".join(_num(x, 2) for x in v) if k.startswith("loadavg") and isinstance(v, list) else v

    rows = [(k, value(k)) for k in keys if k in env]
    return _table(("item", "value"), rows)


def _sig3(x) -> str:
    """Three significant digits: a component time is a median of a few runs whose spread is not recorded."""
    if x is None or not math.isfinite(x) or x == 0:
        return _num(x)
    return spread.fmt(x, 2 - math.floor(math.log10(abs(x))))


def _components_md(components: Mapping) -> str:
    if not components:
        return "_components.json missing_"
    rows = []
    for workload, c in components.items():
        den = ", ".join(f"S={s}: {_sig3(v)}" for s, v in c["denoise_ms"].items())
        if c.get("heads_ms"):  # several heads: each head's prepare + denoise on the shared prefix
            den = ", ".join(f"{h}: {_sig3(v)}" for h, v in c["heads_ms"].items())
        dec = ", ".join(f"{b}: {_sig3(v)}" for b, v in c["decode_step_ms"].items())
        rows.append((workload, _sig3(c["prefill_ms"]), den, dec))
    heads = any(c.get("heads_ms") for c in components.values())
    return _table(("workload", "prefix pass T_pre (ms)" if heads else "prefill T_pre (ms)",
                   "heads: prepare + denoise (ms)" if heads else "denoise S steps (ms)",
                   "decode step t(B) (ms), B: t"), rows)


def _steps(s) -> str:
    """S of a grid point; 0 means each head's own step count (`eval.bench --heads` without --S)."""
    return "each head's own" if s == 0 else str(s)


def _fanout_md(summary: Sequence[Mapping]) -> str:
    """Per grid point: each setting's frame against the sum of the single-head frames of the same run."""
    lines = []
    groups: dict[tuple, list] = defaultdict(list)
    for r in summary:
        if r.get("heads"):
            groups[_group_key(r)].append(r)
    for (workload, s, n, arrival), recs in sorted(groups.items()):
        heads = recs[0]["heads"]
        single = recs[0].get("single_head_ms") or {}
        lines += [
            f"### {workload}, S = {_steps(s)}, N = {n}, arrivals `{arrival}`, heads {', '.join(heads)}", "",
            "Single-head frames (each head with its own prefix pass, isolated setting, median ms): "
            + (", ".join(f"{h} {_num(single[h], 1)}" for h in heads if h in single) or "–")
            + f"; sum {_num(recs[0].get('sum_single_head_ms'), 1)} ms.", "",
            _table(["setting", _FRAME_HEADER, "frame / sum of single-head frames", "chunks/s"]
                   + [f"{h} action Hz" for h in heads] + ["tokens/s", "avg batch"],
                   [[_setting_label(r), _frame_ms(r), _rate(r, "fanout_ratio", 3), _rate(r, "action_hz", 2)]
                    + [spread.rounded((r.get("head_action_hz") or {}).get(h), r.get("frame_rel_width"), 1)
                       for h in heads]
                    + [_rate(r, "tokens_per_s"), _num(r.get("avg_batch"), 1)] for r in sorted(recs, key=_sort_key)]),
            "",
        ]
    return "\n".join(lines)


_FRAME_HEADER = "frame ms p50 (p25–p75)"
_SPEEDUP_HEADER = "speedup (per-frame p25–p75)"

_MAIN_COLUMNS = (
    ("setting", _setting_label),
    (_FRAME_HEADER, _frame_ms),
    ("p90", lambda r: _ms_like_frame(r, "frame_ms_p90")),
    ("p99", lambda r: _ms_like_frame(r, "frame_ms_p99")),
    ("action Hz", lambda r: _rate(r, "action_hz")),
    ("tokens/s", lambda r: _rate(r, "tokens_per_s")),
    ("avg batch", lambda r: _num(r.get("avg_batch"), 1)),
    ("req. latency (frames)", lambda r: _num(r.get("request_latency_frames_mean"), 1)),
    ("req. latency (ms)", lambda r: _ms_like_frame(r, "request_latency_ms_mean")),
    (_SPEEDUP_HEADER, _speedup),
    ("ideal speedup", lambda r: _num(r["ideal_speedup"], 2)),
    ("ideal ms", lambda r: _ms_like_frame(r, "ideal_frame_ms")),
    ("achieved", lambda r: _rate(r, "achieved_fraction", 2)),
    ("compile s", lambda r: _num(r["compile_s"], 1)),
)


def _records_md(records: Sequence[Mapping]) -> str:
    rows = [[f(r) for _, f in _MAIN_COLUMNS] for r in sorted(records, key=_sort_key)]
    return _table([c for c, _ in _MAIN_COLUMNS], rows)


def _sweep_md(records: Sequence[Mapping], var: str) -> str:
    rows = sorted(records, key=lambda r: (r[var] or 0, _sort_key(r)))
    return _table(
        (var, "setting", _FRAME_HEADER, "action Hz", "tokens/s", "avg batch", "req. latency (frames)", _SPEEDUP_HEADER,
         "ideal speedup"),
        [(r[var], _setting_label(r), _frame_ms(r), _rate(r, "action_hz"), _rate(r, "tokens_per_s"),
          _num(r.get("avg_batch")), _num(r.get("request_latency_frames_mean")), _speedup(r),
          _num(r["ideal_speedup"], 2)) for r in rows],
    )


def _split_adapter(summary: Sequence[Mapping]) -> tuple[list, list]:
    """(records of the base runs, records of the continuous runs with language-adapter requests)."""
    return [r for r in summary if not r.get("adapter_share")], [r for r in summary if r.get("adapter_share")]


def _adapter_md(components: Mapping, adapter_recs: Sequence[Mapping], base: Sequence[Mapping]) -> str:
    """Per decode step and per frame: the language adapter's cost next to base requests, same run."""
    lines = []
    for workload, c in components.items():
        if not c.get("adapter_step_ms"):
            continue
        rows = []
        for b in sorted(c["decode_step_ms"], key=int):
            t0, ta, tm = c["decode_step_ms"][b], c["adapter_step_ms"].get(b), c["mixed_step_ms"].get(b)
            rows.append([b, _sig3(t0), _sig3(ta), _num(ta / t0 if ta else None, 2), _sig3(tm),
                         _num(tm / t0 if tm else None, 2)])
        lines += [f"Decode step, `{workload}` (ms; every slot on the adapter / half the slots on it, vs no bank):", "",
                  _table(["B", "base", "all on adapter", "ratio", "half on adapter", "ratio"], rows), ""]
    rows = []
    for r in adapter_recs:
        twin = next((b for b in base if b["setting"] == "continuous" and _group_key(b) == _group_key(r)
                     and b.get("k") == r.get("k")), None)
        if twin is None:
            continue
        width = max(r.get("frame_rel_width") or 0, twin.get("frame_rel_width") or 0) or None  # the noisier run's
        rows.append([f"{r['workload']} S={r['S']} N={r['N']} k={r['k']}", _num(r["adapter_share"], 2),
                     _ms_like_frame(twin, "frame_ms_mean"), _ms_like_frame(r, "frame_ms_mean"),
                     spread.rounded(r["frame_ms_mean"] / twin["frame_ms_mean"], width),
                     _rate(twin, "tokens_per_s"), _rate(r, "tokens_per_s")])
    if rows:
        lines += ["Continuous batching frames with a share of the requests on the adapter (same requests, same run):",
                  "", _table(["point", "adapter share", "base frame ms", "with adapter", "ratio", "base tokens/s",
                              "with adapter"], rows), ""]
    return "\n".join(lines)


def _load(env: Mapping) -> str:
    """The machine load over the run (os.getloadavg, 1 / 5 / 15 min) against the cores, or that it was not recorded."""
    start, end = env.get("loadavg_start"), env.get("loadavg_end")
    if not start:
        return "machine load not recorded (a run from before `eval.bench` recorded it)"
    at_end = f", at the end {' / '.join(_num(v, 1) for v in end)}" if end else ""
    return (f"machine load average (1 / 5 / 15 min) at the start {' / '.join(_num(v, 1) for v in start)}{at_end}, "
            f"on {env.get('cpu_count', '?')} cores (the bench itself adds about 1; more means other processes shared "
            "the machine and slowed and spread the frames)")


def _measured_md(env: Mapping, summary: Sequence[Mapping]) -> str:
    """What the figures are of: model size, device, machine load, frames, how spreads and rounding read."""
    preset = env.get("preset", summary[0].get("preset"))
    n = env.get("parameters")
    params = ("parameter count not recorded" if not n else f"{n / 1e9:.2f} B parameters" if n >= 1e9
              else f"{n / 1e6:.1f} M parameters" if n >= 1e6 else f"{n:,} parameters")
    model = f"`{preset}`" + (f" from `{env['ckpt']}`" if env.get("ckpt") else " preset, random weights")
    cpu = env.get("cpu_model") or "CPU model not recorded"
    device = (f"{env.get('backend', '?')} backend, {env.get('device_count', '?')} × {env.get('device_kind', '?')}; "
              f"host {cpu}, {env.get('cpu_count', '?')} cores")
    frames = sorted({r.get("frames_measured") for r in summary if r.get("frames_measured")})
    fallback = any(r.get("spread") == "min–max" for r in summary)
    lines = [
        f"- **model**: {model}, {params}, `{env.get('dtype', summary[0].get('dtype'))}`",
        f"- **device**: {device}",
        f"- **load**: {_load(env)}",
        f"- **frames**: {', '.join(map(str, frames)) or '?'} measured per setting and grid point; "
        f"{env.get('timestamp', 'time not recorded')}, commit `{env.get('commit', '?')}`",
        "- **spread and rounding**: a frame time is the median over the measured frames with their "
        + ("p25–p75 (min–max where a run file is missing)" if fallback else "interquartile range p25–p75")
        + " in parentheses; a speedup is the ratio of mean frame times with the p25–p75 of the per-frame ratios "
        "(isolated frame f / this setting's frame f). Each figure is rounded so that its last digit is the "
        "leading digit of its spread; Hz, tokens/s and *achieved* carry the frames' relative spread. Component "
        "times are medians of `--component-repeats` runs whose spread is not recorded: three significant digits.",
    ]
    if preset == "tiny":
        lines.append("- **tiny preset: these figures measure per-call overhead, not the method.** A tiny frame takes "
                     "milliseconds, so dispatch and host work dominate it and the settings' ratios are not those of a "
                     "real model; the quick run checks that every setting compiles, runs and reports.")
    return "\n".join(lines)


def markdown(results: Mapping, plots: Sequence[str]) -> str:
    runs = results.get("run_files") or {}
    summary, adapter_recs = _split_adapter(spread.annotate(results["summary"], runs))
    ref = reference_point(summary)
    env = results["environment"]
    fanout = _fanout_md(summary)
    out = [
        "# OxyGen benchmark report", "",
        "## What was measured", "", _measured_md(env, summary), "",
        f"{len(summary)} records. Frame times are wall time from the frame's tick to actions and tokens on the "
        "host, over measured frames (warm-up excluded); Hz and tokens/s are ratios of sums; request latency runs "
        "from the arrival frame's tick to the end of the frame emitting the last token. *speedup* = isolated mean "
        "frame time / this setting's (same frames, same run); *ideal* values come from component times measured "
        "alone (`eval.bench.metrics.ideal_frame_ms`); *achieved* = ideal frame time / measured mean frame time.", "",
        "## Environment", "", _environment_md(env), "",
        "## Component times", "", _components_md(results["components"]), "",
        *(["## Fan-out: several heads and language on one prefix", "",
            "*frame / sum of single-head frames* = this setting's median frame (all heads, and language where the "
            "setting has it) / the median, over the same run's isolated frames, of the sum of each head's own "
            "frame (its own prefix pass + prepare + denoise, no language). Per-head action Hz = that head's "
            "horizon per frame; chunks/s = frames per second.", "", fanout, ""] if fanout else []),
        "## Ablation at the reference point", "",
        f"workload `{ref['workload']}`, S = {_steps(ref['S'])}, N = {ref['N']}, arrivals `{ref['arrival']}`"
        + (f", continuous batching at k = {ref['k']}" if ref["k"] else ""), "",
        _records_md(_pick_cb(_at(summary, ref), ref["k"])), "",
        f"## Sweep over N (S = {_steps(ref['S'])}, k = {ref['k']})", "",
        _sweep_md(_pick_cb(_n_series(summary, ref), ref["k"]), "N"), "",
        f"## Sweep over k (S = {_steps(ref['S'])}, N = {ref['N']})", "",
        _sweep_md([r for r in _at(summary, ref) if r["setting"] == "continuous"], "k"), "",
        "## Every grid point", "",
    ]
    groups: dict[tuple, list] = defaultdict(list)
    for r in summary:
        groups[_group_key(r)].append(r)
    for (workload, s, n, arrival), recs in sorted(groups.items()):
        out += [f"### {workload}, S = {_steps(s)}, N = {n}, arrivals `{arrival}`", "", _records_md(recs), ""]
    notes = []
    bad = sorted({(r["N"], r["k"]) for r in summary if r.get("k_divides_N") is False})
    if bad:
        notes.append("k does not divide N (each request's last burst is short) at (N, k) = " + ", ".join(map(str, bad)))
    unfinished = sum(r.get("requests_unfinished") or 0 for r in summary)
    if unfinished:
        notes.append(f"{unfinished} requests arriving in measured frames had not finished when the run ended "
                     "(excluded from request latency; pass more frames, --drain or more --slots)")
    if summary[0].get("fixed_length_decode", True):
        notes.append("fixed-length decode: every request decodes exactly min(t_max, N) tokens (stop token disabled)")
    notes.append("parallel reuses the isolated action and text executables, so its compile time is theirs")
    if fanout:
        notes.append("several heads: action Hz is the chunk rate (frames per second; every head delivers one chunk "
                     "per frame); S = each head's own means XR0 5, StarVLA heads 4 denoise steps")
    adapter = _adapter_md(results["components"], adapter_recs, summary)
    if adapter:
        out += ["## Language adapter overhead", "", adapter, ""]
    out += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    out += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(out)


# --- plots ----------------------------------------------------------------------------------------


def _pyplot():
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tradeoff(summary: Sequence[Mapping], path: Path) -> None:
    """Tokens/s against action Hz, one panel per workload, colour = setting, labels = (N, k)."""
    plt = _pyplot()
    workloads = sorted({r["workload"] for r in summary})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.8), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        recs = [r for r in summary
                if r["workload"] == w and r["action_hz"] is not None and r["tokens_per_s"] is not None]
        annotate = len(recs) <= 40
        for setting in SETTING_ORDER:
            pts = [r for r in recs if r["setting"] == setting]
            if not pts:
                continue
            ax.scatter([r["action_hz"] for r in pts], [r["tokens_per_s"] for r in pts], color=COLORS[setting],
                       label=LABELS[setting], s=36, alpha=0.85, edgecolors="none")
            if annotate:
                for r in pts:
                    text = f"N{r['N']}" + (f",k{r['k']}" if r.get("k") else "")
                    ax.annotate(text, (r["action_hz"], r["tokens_per_s"]), fontsize=6, xytext=(3, 2),
                                textcoords="offset points", color=COLORS[setting])
        ax.set_xlabel("action frequency (Hz)")
        ax.set_ylabel("language tokens / s")
        ax.set_title(f"{w}: language throughput vs action rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ablation(summary: Sequence[Mapping], ref: Mapping, path: Path) -> None:
    """Bars at the reference point: measured frame time (ideal as a marker) and speedup (ideal as a marker)."""
    plt = _pyplot()
    recs = sorted(_pick_cb(_at(summary, ref), ref["k"]), key=_sort_key)
    names = [_setting_label(r) for r in recs]
    colors = [COLORS[r["setting"]] for r in recs]
    x = list(range(len(recs)))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.bar(x, [r["frame_ms_median"] or 0 for r in recs], color=colors)
    a1.scatter(x, [r.get("ideal_frame_ms") or math.nan for r in recs], marker="_", s=600, color="black",
               label="ideal (components)", zorder=3)
    a1.set_ylabel("frame time, median (ms)")
    a2.bar(x, [r["speedup_vs_isolated"] or 0 for r in recs], color=colors)
    a2.scatter(x, [r["ideal_speedup"] or math.nan for r in recs], marker="_", s=600, color="black",
               label="ideal speedup", zorder=3)
    a2.axhline(1.0, color="gray", lw=0.8, ls="--")
    a2.set_ylabel("speedup over isolated")
    for ax in (a1, a2):
        ax.set_xticks(x, names, rotation=15, fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"ablation: {ref['workload']}, S={ref['S']}, N={ref['N']}, {ref['arrival']}"
                 + (f", k={ref['k']}" if ref["k"] else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _lines(ax, recs, var: str, metric: str) -> None:
    by: dict[str, list] = defaultdict(list)
    for r in recs:
        by[r["setting"]].append(r)
    for setting in SETTING_ORDER:
        pts = sorted((r for r in by.get(setting, []) if r[metric] is not None), key=lambda r: r[var])
        if pts:
            ax.plot([r[var] for r in pts], [r[metric] for r in pts], marker="o", color=COLORS[setting],
                    label=LABELS[setting])


def plot_sweep_n(summary: Sequence[Mapping], ref: Mapping, path: Path) -> None:
    """Action Hz and tokens/s over N at the reference S, arrival and k."""
    plt = _pyplot()
    recs = _pick_cb(_n_series(summary, ref), ref["k"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    _lines(a1, recs, "N", "action_hz")
    _lines(a2, recs, "N", "tokens_per_s")
    a1.set_ylabel("action frequency (Hz)")
    a2.set_ylabel("language tokens / s")
    for ax in (a1, a2):
        ax.set_xlabel("decode length N")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"sweep over N: {ref['workload']}, S={ref['S']}, {ref['arrival']}"
                 + (f", continuous at k={ref['k']}" if ref["k"] else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep_k(summary: Sequence[Mapping], ref: Mapping, path: Path) -> None:
    """Continuous batching over k at the reference N: Hz, tokens/s and request latency; others as lines."""
    plt = _pyplot()
    recs = _at(summary, ref)
    cb = sorted((r for r in recs if r["setting"] == "continuous"), key=lambda r: r["k"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, label in zip(axes, ("action_hz", "tokens_per_s", "request_latency_frames_mean"),
                                 ("action frequency (Hz)", "language tokens / s", "request latency (frames)")):
        if cb:
            ax.plot([r["k"] for r in cb], [r[metric] if r[metric] is not None else math.nan for r in cb], marker="o",
                    color=COLORS["continuous"], label=LABELS["continuous"])
        for r in recs:
            if r["setting"] != "continuous" and r[metric] is not None:
                ax.axhline(r[metric], color=COLORS[r["setting"]], ls="--", lw=1, label=LABELS[r["setting"]])
        ax.set_xlabel("tokens per request per frame k")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"sweep over k: {ref['workload']}, S={ref['S']}, N={ref['N']}, {ref['arrival']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency_vs_batch(runs: Sequence[Mapping], components: Mapping, path: Path) -> None:
    """Left: measured frame time against requests in the frame's decode (all settings, medians as lines).
    Right: the decode step t(B) measured alone, per workload."""
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    points: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        for f in run.get("frames", []):
            if not f.get("warmup") and not f.get("drain") and "adapter" not in f.get("label", ""):
                points[f["setting"]][int(f["batch"])].append(float(f["frame_ms"]))
    for setting in SETTING_ORDER:
        if setting not in points:
            continue
        by_batch = points[setting]
        xs = [b for b, v in by_batch.items() for _ in v]
        ys = [ms for v in by_batch.values() for ms in v]
        a1.scatter(xs, ys, s=6, alpha=0.25, color=COLORS[setting], edgecolors="none")
        bs = sorted(by_batch)
        meds = [sorted(by_batch[b])[len(by_batch[b]) // 2] for b in bs]
        a1.plot(bs, meds, marker="o", color=COLORS[setting], label=f"{LABELS[setting]} (median)")
    every = sorted(ms for by_batch in points.values() for v in by_batch.values() for ms in v)
    if every:  # keep rare host hiccups from flattening the plot
        a1.set_ylim(0, 1.25 * every[min(len(every) - 1, int(0.99 * len(every)))])
    a1.set_xlabel("active requests in the frame")
    a1.set_ylabel("frame time (ms)")
    a1.set_title("frame latency vs active requests", fontsize=10)
    a1.grid(alpha=0.3)
    if points:
        a1.legend(fontsize=7)
    for workload, c in components.items():
        bs = sorted(int(b) for b in c["decode_step_ms"])
        a2.plot(bs, [c["decode_step_ms"][str(b)] for b in bs], marker="o", label=workload)
    a2.set_xlabel("batch B")
    a2.set_ylabel("one decode step t(B) (ms)")
    a2.set_ylim(bottom=0)
    a2.set_title("decode step vs batch (measured alone)", fontsize=10)
    a2.grid(alpha=0.3)
    if components:
        a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_fanout(summary: Sequence[Mapping], path: Path) -> None:
    """Per grid point with several heads: each setting's median frame next to the single-head frames of the same
    run stacked (their sum is the fan-out ratio's denominator), the ratio written over each bar."""
    plt = _pyplot()
    groups: dict[tuple, list] = defaultdict(list)
    for r in summary:
        if r.get("heads"):
            groups[_group_key(r)].append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.4), squeeze=False)
    for ax, (key, recs) in zip(axes[0], sorted(groups.items())):
        recs = sorted(recs, key=_sort_key)
        heads, single = recs[0]["heads"], recs[0].get("single_head_ms") or {}
        bottom = 0.0
        for i, h in enumerate(heads):
            if h in single:
                ax.bar(0, single[h], bottom=bottom, color=("#d9d9d9", "#bdbdbd", "#969696", "#737373")[i % 4],
                       edgecolor="black", linewidth=0.5, hatch="//", label=f"{h} alone")
                bottom += single[h]
        x = list(range(1, len(recs) + 1))
        ax.bar(x, [r["frame_ms_median"] or 0 for r in recs], color=[COLORS[r["setting"]] for r in recs])
        for xi, r in zip(x, recs):
            if r.get("fanout_ratio") is not None:
                ax.annotate(f"{r['fanout_ratio']:.2f}x", (xi, r["frame_ms_median"] or 0), ha="center", fontsize=8,
                            xytext=(0, 3), textcoords="offset points")
        ax.set_xticks([0] + x, ["sum of\nsingle-head\nframes"] + [_setting_label(r) for r in recs], rotation=15,
                      fontsize=8)
        ax.set_ylabel("frame time, median (ms)")
        ax.set_title(f"{key[0]}, N={key[2]}, {key[3]}: frame / sum of single-head frames", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------


def write_report(results_dir: Path, out_dir: Path | None = None) -> Path:
    """Writes report.md and the PNG plots; returns the path of report.md."""
    results = load_results(Path(results_dir))
    out = Path(out_dir) if out_dir else Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary, _ = _split_adapter(results["summary"])
    missing = [k for k in ("setting", "workload", "S", "N", "k", "arrival", "frame_ms_median", "action_hz",
                           "tokens_per_s", "speedup_vs_isolated", "ideal_speedup", "compile_s") if k not in summary[0]]
    if missing:
        raise ValueError(f"summary.json records lack {missing}; was it written by eval.bench?")
    ref = reference_point(summary)
    plot_tradeoff(summary, out / "tradeoff.png")
    plot_ablation(summary, ref, out / "ablation.png")
    plot_sweep_n(summary, ref, out / "sweep_N.png")
    plot_sweep_k(summary, ref, out / "sweep_k.png")
    plot_latency_vs_batch(results["runs"], results["components"], out / "latency_vs_batch.png")
    plots = PLOTS
    if any(r.get("heads") for r in summary):
        plot_fanout(summary, out / FANOUT_PLOT)
        plots = (FANOUT_PLOT,) + PLOTS
    md = out / "report.md"
    md.write_text(markdown(results, plots))
    return md


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m eval.bench.report",
        description="Markdown tables and PNG plots from an eval.bench result directory (reads summary.json, "
                    "components.json, environment.json and runs/*.json).",
    )
    parser.add_argument("results", type=Path, help="directory written by `python -m eval.bench --out DIR`")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write report.md and the PNGs (default: RESULTS)")
    args = parser.parse_args(argv)
    try:
        md = write_report(args.results, args.out)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(f"wrote {md} and {len(PLOTS)} plots")
    return md


if __name__ == "__main__":
    main()
