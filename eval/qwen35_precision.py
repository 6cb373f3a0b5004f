"""Qwen3.5 parity before and after a change, per quantity, on any set of reference directories.

    python -m eval.qwen35_precision --before /tmp/before_checkout DIR [DIR ...]  > table.md
    python -m eval.qwen35_precision --before /tmp/before_checkout --summary DIR [DIR ...]

Each DIR is a Qwen3.5 reference directory (`../shared/fixtures/qwen35_tiny`, or one written by
`eval/qwen35_refs.py`). `--before` is another checkout of this repository (e.g. `git archive <commit> | tar -x
-C /tmp/before`); the current one is "after". Every directory is compared by `eval.parity.qwen35.run_fixture`
(the slot-pool rows left out) in a subprocess per checkout, and one markdown table per directory lists each
float quantity's max error (hidden states: relative to max |ref|), the tolerance and the error / bound ratio
of both ("-" where the older checkout does not compare it), then a line of failures; `--summary` prints one row per directory instead: the largest error / bound
ratio of each kind of quantity, before -> after. Float32 at XLA's default CPU flags, as `python -m eval.parity`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

_ROWS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from eval.parity import qwen35
_, rows = qwen35.run_fixture(Path(sys.argv[2]), pool=False)
print(json.dumps([dict(q=r.quantity, abs=r.max_abs, rel=r.max_rel, tol=r.tol, ok=r.ok) for r in rows]))
"""


def rows_of(checkout: Path, ref_dir: Path) -> list[dict]:
    """`run_fixture`'s rows for `ref_dir` computed by the code in `checkout` (its own process)."""
    out = subprocess.run([sys.executable, "-c", _ROWS, str(checkout), str(ref_dir)], check=True, capture_output=True, text=True,
                         cwd=checkout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ratio(row: dict) -> float | None:
    """error / bound for a float tolerance ('atol a' or 'atol 0 rtol r'), None for other rows."""
    parts = row["tol"].split()
    if parts[0] != "atol":
        return None
    return row["rel"] / float(parts[3]) if len(parts) > 2 else row["abs"] / float(parts[1])


def _pairs(before: list[dict], after: list[dict]) -> list[tuple[dict | None, dict]]:
    """(before row or None, after row) by quantity, in the after checkout's order."""
    by_name = {r["q"]: r for r in before}
    return [(by_name.get(a["q"]), a) for a in after]


def table(name: str, before: list[dict], after: list[dict]) -> str:
    lines = [f"### {name}", "", "| quantity | tolerance | before | after | before / bound | after / bound |", "|---|---|---|---|---|---|"]
    for b, a in _pairs(before, after):
        if _ratio(a) is None:
            continue
        err = (lambda r: r["rel"]) if "rtol" in a["tol"] else (lambda r: r["abs"])
        cell = lambda r, f: "-" if r is None else f(r)  # noqa: E731
        show = lambda r: f"{err(r):.3g}" + ("" if r["ok"] else " FAIL")  # noqa: E731
        lines.append(f"| {a['q']} | {a['tol']} | {cell(b, show)} | {show(a)} | {cell(b, lambda r: f'{_ratio(r):.2f}')} | {_ratio(a):.2f} |")
    fails = [sum(not r["ok"] for r in rows) for rows in (before, after)]
    lines += ["", f"Failed: before {fails[0]} of {len(before)}, after {fails[1]} of {len(after)} "
              f"(exact rows such as greedy tokens included, not listed)."]
    return "\n".join(lines)


_KINDS = (("logits", ("logits (valid",)), ("hidden", ("hidden_states",)), ("K/V", ("k_cache", "v_cache")),
          ("projections", ("gdn_qkv", "gdn_z", "gdn_a", "gdn_b")), ("core", ("gdn_core",)),
          ("conv windows", ("conv_states, rows", "conv_states, every")), ("states", ("recurrent_states, rows", "recurrent_states, every")),
          ("decode", ("decode step logits", "after decoding")))


def summary_row(name: str, before: list[dict], after: list[dict]) -> str:
    """One markdown row: per kind of quantity, the largest error / bound before -> after; then the failures."""
    cells = []
    for _, keys in _KINDS:
        pick = [(b, a) for b, a in _pairs(before, after) if _ratio(a) is not None and any(k in a["q"] for k in keys)]
        was = [_ratio(b) for b, _ in pick if b is not None]
        cells.append(f"{max(was):.2f} -> {max(_ratio(a) for _, a in pick):.2f}" if pick and was else
                     (f"- -> {max(_ratio(a) for _, a in pick):.2f}" if pick else "-"))
    fails = [sum(not r["ok"] for r in rows) for rows in (before, after)]
    return f"| {name} | " + " | ".join(cells) + f" | {fails[0]} -> {fails[1]} of {len(after)} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.qwen35_precision", description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    ap.add_argument("--summary", action="store_true", help="one row per directory instead of a table each")
    ap.add_argument("dirs", type=Path, nargs="+", help="Qwen3.5 reference directories")
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    if args.summary:
        print("| directory | " + " | ".join(k for k, _ in _KINDS) + " | failed |")
        print("|---" * (len(_KINDS) + 2) + "|")
    for d in args.dirs:
        before, after = rows_of(args.before.resolve(), d.resolve()), rows_of(here, d.resolve())
        print(summary_row(d.name, before, after) if args.summary else table(d.name, before, after) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
