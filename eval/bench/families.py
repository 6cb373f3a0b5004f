"""The three families side by side: π0.5 (S = 10), XR0 (S = 5) and StarVLA QwenPI_v3 (S = 4) at bench scale.

    python -m eval.bench.families --out eval/results/cpu_bench_families            # runs the three, writes the table
    python -m eval.bench.families --out eval/results/cpu_bench_families --table-only   # the table from earlier runs

Each family is one `python -m eval.bench` run (LIBERO workload, one language request per frame, the
settings isolated / shared_kv / continuous interleaved frame by frame, N = 5, 10, 20, 30, k = 5) into
`OUT/<family>/`: π0.5 on `--preset bench`, XR0 and StarVLA QwenPI_v3 as single heads with the language
decoder on `mot.preset("bench")`'s Qwen3-VL-shaped backbone (`--heads xr0` / `--heads starvla`, square
`--image-size` images). The table (`OUT/families.md`, `OUT/families.json`) gives, per family and N, the
isolated frame time and each setting's speedup over isolated in the same run (`speedup_vs_isolated`:
isolated mean frame / the setting's), beside the speedups of continuous batching published for an RTX 4090
(the issue's numbers), and each run's component times (prefix pass, the head's denoise, one decode step)
to explain the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

N_VALUES = (5, 10, 20, 30)
SETTINGS = ("isolated", "shared_kv", "continuous")
# family -> (eval.bench arguments, S), in table order.
FAMILIES = {
    "pi05": (["--preset", "bench"], 10),
    "xr0": (["--preset", "bench", "--heads", "xr0"], 5),
    "starvla_qwenpi_v3": (["--preset", "bench", "--heads", "starvla"], 4),
    # StarVLA QwenPI_v3 on a Qwen3.5-shaped prefix (issue 16): N = 30 only, an isolated frame takes ~5 s here.
    "qwen35_starvla_qwenpi_v3": (["--preset", "qwen35_bench", "--heads", "starvla"], 4),
    # StarVLA's GR00T head (flow-matching DiT on the last hidden state) on the same prefix.
    "qwen35_starvla_gr00t": (["--preset", "qwen35_bench", "--heads", "gr00t"], 4),
}
# The N values a family runs at (default N_VALUES).
FAMILY_N = {"qwen35_starvla_qwenpi_v3": (30,), "qwen35_starvla_gr00t": (30,)}
# Continuous batching's speedup over isolated on an RTX 4090 at N = 5, 10, 20, 30 (issue 15, as published).
PUBLISHED_4090 = {"pi05": (1.27, 1.60, 2.35, 2.98), "xr0": (1.03, 1.40, 2.31, 3.14),
                  "starvla_qwenpi_v3": (1.07, 1.51, 2.47, 3.41),
                  "qwen35_starvla_qwenpi_v3": (None, None, None, 3.53),  # Qwen3.5-0.8B: N = 30 published
                  "qwen35_starvla_gr00t": (None, None, None, None)}  # the one published Qwen3.5 number sits beside QwenPI_v3


def bench_argv(family: str, out: Path, *, frames: int, image_size: int) -> list[str]:
    """The `python -m eval.bench` arguments of one family's run."""
    args, s = FAMILIES[family]
    if "--heads" in args:
        args = args + ["--image-size", str(image_size)]
    return args + ["--workloads", "libero", "--S", str(s), "--N", *map(str, FAMILY_N.get(family, N_VALUES)), "--k", "5", "--frames",
                   str(frames), "--settings", *SETTINGS, "--component-batches", "1,2,4,8", "--out", str(out),
                   "--no-progress"]


def rows(summaries: Mapping[str, Sequence[Mapping]]) -> list[dict]:
    """One row per (family, N): isolated ms, each setting's speedup, the published continuous speedup."""
    out = []
    for family, records in summaries.items():
        by = {(r["setting"], r["N"]): r for r in records if r["workload"] == "libero"}
        for i, n in enumerate(N_VALUES):
            iso = by.get(("isolated", n))
            if iso is None:
                continue
            row = {"family": family, "S": iso["S"] or FAMILIES[family][1], "N": n, "isolated_ms": iso["frame_ms_median"]}
            for s in SETTINGS[1:]:
                rec = by.get((s, n))
                row[f"{s}_ms"] = None if rec is None else rec["frame_ms_median"]
                row[f"{s}_speedup"] = None if rec is None else rec["speedup_vs_isolated"]
            row["published_4090_continuous"] = PUBLISHED_4090[family][i]
            out.append(row)
    return out


def _f(x, digits=2) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def table(table_rows: Sequence[Mapping]) -> str:
    """The markdown table of `rows`."""
    lines = ["| family | S | N | isolated ms | shared_kv ms | continuous ms (k=5) | shared_kv speedup | "
             "continuous speedup | published RTX 4090 (continuous) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in table_rows:
        lines.append(f"| {r['family']} | {r['S']} | {r['N']} | {_f(r['isolated_ms'], 0)} | {_f(r['shared_kv_ms'], 0)} | "
                     f"{_f(r['continuous_ms'], 0)} | {_f(r['shared_kv_speedup'])}× | {_f(r['continuous_speedup'])}× | "
                     f"{_f(r['published_4090_continuous'])}× |")
    return "\n".join(lines)


def components(out: Path) -> dict:
    """family -> LIBERO component times (ms) of its run: prefix pass, denoise (π0.5) or head, decode t(B)."""
    res = {}
    for family in FAMILIES:
        path = out / family / "components.json"
        if path.is_file():
            c = json.loads(path.read_text())["libero"]
            res[family] = {"prefix_ms": c["prefill_ms"],
                           "actions_ms": next(iter((c.get("denoise_ms") or c.get("heads_ms") or {None: None}).values())),
                           "decode_step_ms": c["decode_step_ms"]}
    return res


def slot_memory(summaries: Mapping[str, Sequence[Mapping]]) -> dict[str, dict]:
    """family -> one slot's bytes by part (`harness.pool_slot_bytes`) in its continuous run at the largest N."""
    res = {}
    for family, records in summaries.items():
        runs = [r for r in records if r["setting"] == "continuous" and r.get("slot_bytes")]
        if runs:
            res[family] = max(runs, key=lambda r: r["N"])["slot_bytes"]
    return res


def write(out: Path) -> str:
    """Writes OUT/families.{json,md} from OUT/<family>/summary.json; returns the markdown."""
    summaries = {f: json.loads((out / f / "summary.json").read_text()) for f in FAMILIES if (out / f / "summary.json").is_file()}
    if not summaries:
        raise SystemExit(f"{out}: no <family>/summary.json to tabulate (run without --table-only first)")
    env = {f: json.loads((out / f / "environment.json").read_text()) for f in summaries}
    for f in summaries:  # the load this command saw around each run (π0.5's environment.json has none)
        if (out / f / "load.json").is_file():
            env[f] |= json.loads((out / f / "load.json").read_text())
    comp = components(out)
    table_rows = rows(summaries)
    slots = slot_memory(summaries)
    md = [table(table_rows), "", "| family | prefix pass ms | actions ms (denoise / head) | decode step ms B=1 / 8 | "
          "one slot KiB: K/V + window + state (largest N) |", "|---|---|---|---|---|"]
    for f, c in comp.items():
        d, m = c["decode_step_ms"], slots.get(f)
        mem = "–" if m is None else f"{m['kv'] / 1024:,.0f} + {m.get('window', 0) / 1024:,.0f} + {m.get('state', 0) / 1024:,.0f}"
        md.append(f"| {f} | {_f(c['prefix_ms'], 1)} | {_f(c['actions_ms'], 1)} | {_f(d.get('1'), 1)} / {_f(d.get('8'), 1)} | {mem} |")
    md.append("(one slot = what the continuous run's pool holds per request; – for runs recorded before the bench "
              "reported it; window + state are Qwen3.5's fixed linear-layer state, the same at any N)")
    machine = {f: {k: e.get(k) for k in ("backend", "device_kind", "cpu_count", "platform", "commit", "timestamp", "loadavg_start", "loadavg_end") if k in e}
               for f, e in env.items()}
    md += ["", "Machine: " + "; ".join(f"{f}: {json.dumps(m)}" for f, m in machine.items())]
    (out / "families.json").write_text(json.dumps({"rows": table_rows, "components": comp, "slot_bytes": slots,
                                                   "machine": machine}, indent=1))
    text = "\n".join(md) + "\n"
    (out / "families.md").write_text(text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.bench.families", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="result directory (one subdirectory per family)")
    ap.add_argument("--frames", type=int, default=6, help="measured frames per (setting, N)")
    ap.add_argument("--image-size", type=int, default=224, help="XR0 / StarVLA camera image side (px, multiple of 32)")
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--table-only", action="store_true", help="only (re)write the table from earlier runs")
    args = ap.parse_args(argv)
    if not args.table_only:
        from eval.bench.__main__ import main as bench

        import jax

        for family in args.families:
            start = os.getloadavg()
            bench(bench_argv(family, args.out / family, frames=args.frames, image_size=args.image_size))
            jax.clear_caches()
            (args.out / family / "load.json").write_text(json.dumps({"loadavg_start": start, "loadavg_end": os.getloadavg()}))
    print(write(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
