"""`python -m eval.bench.repeat_report DIR`: the table and plots of a repeat-workload run (`eval.bench.repeat`).

Reads DIR/repeat.json and writes into DIR:

    report.md      one row per (p, setting): frame p50 / p90, ideal frame from the components, action Hz, tokens/s,
                   latency in frames (all, repeated, fresh), tokens per (slot, step), and each speculative setting
                   against plain continuous batching (latency ratio, action-Hz ratio, whether both hold:
                   latency at most half, action Hz within 10 %)
    repeat.png     six panels over p, one line per setting: frame time (measured, ideal dashed), action Hz,
                   tokens/s, latency in frames, tokens per step, latency and action Hz as ratios to plain, the
                   target region shaded
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

_PANELS = (  # (result key, title)
    ("frame_ms_median", "frame time p50 (ms; ideal dashed)"),
    ("action_hz", "action Hz (Ha · frames / Σ frame time)"),
    ("tokens_per_s", "language tokens/s"),
    ("latency_frames_mean", "request latency (frames)"),
    ("tokens_per_step", "tokens per (slot, step)"),
)


def _settings(record: dict) -> list[str]:
    return ["plain", *record.get("specs", {"speculative": None})]


def verdicts(record: dict) -> list[dict]:
    """Per (p, speculative setting): latency and action-Hz ratios to plain and whether both targets hold."""
    rows = []
    for res in record["results"]:
        plain = res["plain"]
        for name in _settings(record)[1:]:
            s = res[name]
            lat = s["latency_frames_mean"] / plain["latency_frames_mean"]
            hz = s["action_hz"] / plain["action_hz"]
            rows.append({"p": res["p"], "setting": name, "latency_ratio": lat, "action_hz_ratio": hz,
                         "meets": lat <= 0.5 and hz >= 0.9})
    return rows


def _f(x: float, spec: str = ".0f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report_md(record: dict) -> str:
    comp = record["components"]
    lines = [f"# Repeat workload: speculative decoding beside continuous batching", "",
             f"`{record.get('command', 'python -m eval.bench.repeat')}`", "",
             f"- model: `{record['preset']}` preset, {record['dtype']}, VLM expert scaled by {record['text_scale']:g}; "
             f"S = {record['S']}, N = {record['N']} tokens per request, k = {record['k']}, {record['slots']} slots, "
             f"{record['robots']} robot(s), {record['frames']} measured frames per p",
             f"- device: {record['backend']} ({record.get('device', '–')}); load average (1 / 5 / 15 min) "
             f"{' / '.join(_f(x, '.1f') for x in record.get('loadavg_start', [math.nan] * 3))} at the start, "
             f"{' / '.join(_f(x, '.1f') for x in record['loadavg'])} at the end",
             "- components (warm medians, interleaved): " + ", ".join(f"{k} {v:.1f}" for k, v in comp.items()), ""]
    for k, v in comp.items():
        if k.startswith("verify_step_ms_g"):
            lines.append(f"  - verify step at γ = {k.rsplit('g', 1)[1]} / decode step: {v / comp['decode_step_ms']:.2f}")
    lines += ["", "| p | setting | frame p50 ms | p90 ms | ideal ms | action Hz | tokens/s | latency (frames) "
              "| repeated | fresh | tokens per step | steps per frame |", "|---" * 12 + "|"]
    for res in record["results"]:
        for name in _settings(record):
            r = res[name]
            lines.append(f"| {res['p']:g} | {name} | {_f(r['frame_ms_median'])} | {_f(r['frame_ms_p90'])} | "
                         f"{_f(r.get('ideal_frame_ms'))} | {_f(r['action_hz'], '.2f')} | {_f(r['tokens_per_s'], '.1f')} | "
                         f"{_f(r['latency_frames_mean'], '.2f')} | {_f(r.get('latency_repeat_mean'), '.2f')} | "
                         f"{_f(r.get('latency_fresh_mean'), '.2f')} | {_f(r['tokens_per_step'], '.2f')} | "
                         f"{_f(r.get('steps_per_frame'), '.2f')} |")
    lines += ["", "Against plain continuous batching (target: latency at most half, action Hz within 10 %):", "",
              "| p | setting | latency / plain | action Hz / plain | both |", "|---|---|---|---|---|"]
    for v in verdicts(record):
        lines.append(f"| {v['p']:g} | {v['setting']} | {v['latency_ratio']:.2f} | {v['action_hz_ratio']:.2f} | "
                     f"{'yes' if v['meets'] else 'no'} |")
    same = all(r["same_tokens"] for r in record["results"])
    lines += ["", f"Same tokens in every setting at every p: {'yes' if same else 'NO'}.", "",
              "![repeat workload](repeat.png)", ""]
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = [r["p"] for r in record["results"]]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title) in zip(axes.flat, _PANELS):
        for i, name in enumerate(_settings(record)):
            color = f"C{i}"
            ax.plot(ps, [r[name][key] for r in record["results"]], "o-", color=color, label=name)
            if key == "frame_ms_median":
                ax.plot(ps, [r[name].get("ideal_frame_ms", math.nan) for r in record["results"]], "--", color=color)
        ax.set_title(title)
        ax.set_xlabel("p (repeat probability)")
        ax.grid(alpha=0.3)
    ax = axes.flat[5]  # each speculative setting against plain, the target region shaded
    ax.axvspan(0.9, 1.2, ymin=0, ymax=0.5 / 1.3, color="C2", alpha=0.12, label="target")
    for i, name in enumerate(_settings(record)[1:], start=1):
        pts = [(v["action_hz_ratio"], v["latency_ratio"], v["p"]) for v in verdicts(record) if v["setting"] == name]
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], "o-", color=f"C{i}")
        for x, y, p in pts:
            ax.annotate(f"p={p:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(0.5, 1.2)
    ax.set_ylim(0, 1.3)
    ax.set_title("against plain: latency ratio vs action-Hz ratio")
    ax.set_xlabel("action Hz / plain")
    ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"repeat workload, {record['preset']} preset, {record['backend']} "
                 f"(N = {record['N']}, k = {record['k']}, load {record['loadavg'][0]:.1f} at the end)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.bench.repeat_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="a folder holding repeat.json")
    args = ap.parse_args(argv)
    path = args.dir / "repeat.json"
    if not path.is_file():
        raise SystemExit(f"{path} not found: run `python -m eval.bench.repeat --out {args.dir}` first")
    record = json.loads(path.read_text())
    (args.dir / "report.md").write_text(report_md(record))
    plot(record, args.dir / "repeat.png")
    print(f"wrote {args.dir / 'report.md'} and {args.dir / 'repeat.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
