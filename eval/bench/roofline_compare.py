"""`python -m eval.bench.roofline_compare`: two checkouts' `eval.roofline` runs side by side, run by run.

    python -m eval.bench.roofline_compare --before B1 B2 --after A1 A2 --out DIR

Each argument is the output folder of one `python -m eval.roofline` run (its `roofline.json`); runs are paired in
the order given (B1 with A1, ...), which should be the order they ran in, alternating, so that a pair saw about the
same load. Writes DIR/compare.md: per component and pair, the two times, their ratio (after / before), each run's
fraction of its limit (from the peaks that run measured) and load; then the medians over the pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _read(folder: Path) -> dict:
    path = folder / "roofline.json"
    if not path.is_file():
        raise SystemExit(f"roofline_compare: no {path}; pass folders written by `python -m eval.roofline --out`")
    return json.loads(path.read_text())


def compare(before: list[dict], after: list[dict], labels: tuple[str, str] = ("before", "after")) -> str:
    """The markdown table of `main` for runs paired in order."""
    if len(before) != len(after) or not before:
        raise ValueError(f"pair the runs: got {len(before)} before and {len(after)} after")
    comps = [c["name"] for c in after[0]["components"]]
    by = lambda run: {c["name"]: c for c in run["components"]}  # noqa: E731
    b, a = [by(r) for r in before], [by(r) for r in after]
    lines = [f"| component | pair | {labels[0]} ms | {labels[1]} ms | ratio | fraction {labels[0]} | fraction {labels[1]} |",
             "|---|---|---|---|---|---|---|"]
    for name in comps:
        rows = [(x[name], y[name]) for x, y in zip(b, a) if name in x and name in y]
        for i, (x, y) in enumerate(rows):
            lines.append(f"| {name} | {i + 1} | {x['ms']:,.1f} | {y['ms']:,.1f} | {y['ms'] / x['ms']:.2f} | "
                         f"{x['fraction_of_limit']:.2f} | {y['fraction_of_limit']:.2f} |")
        med = lambda key, runs: float(np.median([r[key] for r in runs]))  # noqa: E731
        xs, ys = [x for x, _ in rows], [y for _, y in rows]
        lines.append(f"| **{name}** | median | {med('ms', xs):,.1f} | {med('ms', ys):,.1f} | "
                     f"{float(np.median([y['ms'] / x['ms'] for x, y in rows])):.2f} | {med('fraction_of_limit', xs):.2f} | "
                     f"{med('fraction_of_limit', ys):.2f} |")
    runs = [f"- pair {i + 1}: " + "; ".join(
        f"{lab} load {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}, read stream {r['peaks']['bandwidth'] / 1e9:.1f} "
        f"GB/s, matmul {r['peaks']['matmul_flops'] / 1e9:.0f} GFLOP/s" for lab, r in zip(labels, pair))
        for i, pair in enumerate(zip(before, after))]
    return "\n".join(lines + [""] + runs) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.bench.roofline_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", nargs="+", type=Path, required=True)
    ap.add_argument("--after", nargs="+", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    text = compare([_read(p) for p in args.before], [_read(p) for p in args.after])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
