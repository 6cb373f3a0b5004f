"""Qwen3.5 parity before and after a change, per quantity, on any set of reference directories.

    python -m eval.results.qwen35_precision.run --before /tmp/before_checkout DIR [DIR ...]  > table.md
    python -m eval.results.qwen35_precision.run --before /tmp/before_checkout --summary DIR [DIR ...]
    python -m eval.results.qwen35_precision.run --before /tmp/before_checkout --exact OUT_DIR DIR   # against reference_f64.npz

Each DIR is a Qwen3.5 reference directory (`../shared/fixtures/qwen35_tiny`, or one written by
`eval/refs/qwen35_refs.py`). `--before` is another checkout of this repository (e.g. `git archive <commit> | tar -x
-C /tmp/before`); the current one is "after". Every directory is compared by `eval.parity.qwen35.run_fixture`
(the slot-pool rows left out) in a subprocess per checkout, and one markdown table per directory lists each
float quantity's max error (hidden states: relative to max |ref|), the tolerance and the error / bound ratio
of both ("-" where the older checkout does not compare it), then a line of failures; `--summary` prints one row per directory instead: the largest error / bound
ratio of each kind of quantity, before -> after. Float32 at the XLA flags of the environment (XLA's defaults
unless XLA_FLAGS says otherwise), as `python -m eval.parity`.

`--exact OUT_DIR` compares both checkouts with the float64 reference DIR/reference_f64.npz instead (one DIR):
the older one by `run_fixture` on a copy of DIR whose reference.npz is the float64 one with the float32 run's
inputs (the pixels the models were fed), this one by `eval.parity.qwen35.compare_fixture`, which also gives
transformers' own float32 error per quantity, rms errors and per-layer errors; this one runs a second time
with in-order decode steps (`Qwen35Spec.step_sums`). OUT_DIR receives results.json and table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_ROWS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from eval.parity import qwen35
_, rows = qwen35.run_fixture(Path(sys.argv[2]), pool=False)
print(json.dumps([dict(q=r.quantity, abs=r.max_abs, rel=r.max_rel, tol=r.tol, ok=r.ok) for r in rows]))
"""

_FIDELITY = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from eval.parity import qwen35
result = qwen35.compare_fixture(Path(sys.argv[2]), pool=False, step_sums=(sys.argv[3:] or [None])[0])
print(json.dumps(dict(factor=qwen35.EXACT_FACTOR, step_sums=result.spec.step_sums,
                      rows=[dataclasses.asdict(r) for r in result.fidelity])))
"""

# Float inputs the models are fed: the float64 reference stores its own (float64) processor output under this
# name, a quantity of its own; the exact comparison feeds both checkouts the float32 run's.
_INPUTS = ("vl_pixel_values",)


def rows_of(checkout: Path, ref_dir: Path, script: str = _ROWS, *extra: str):
    """`run_fixture`'s rows for `ref_dir` computed by the code in `checkout` (its own process)."""
    out = subprocess.run([sys.executable, "-c", script, str(checkout), str(ref_dir), *extra], check=True, capture_output=True,
                         text=True, cwd=checkout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _exact_copy(ref_dir: Path, out: Path) -> Path:
    """A copy of `ref_dir` (links) whose reference.npz holds the float64 arrays and the float32 run's inputs."""
    for f in ref_dir.iterdir():
        if f.name not in ("reference.npz", "reference_f64.npz"):
            (out / f.name).symlink_to(f.resolve())
    exact, ref = dict(np.load(ref_dir / "reference_f64.npz")), np.load(ref_dir / "reference.npz")
    exact.update({k: ref[k] for k in _INPUTS if k in ref})
    np.savez(out / "reference.npz", **exact)
    return out


def exact_rows(before: Path, ref_dir: Path) -> dict:
    """Against the float64 reference, per float quantity: the bound, transformers' float32 error, ours before
    (max) and after (max, rms, per layer), and after with in-order decode steps (`Qwen35Spec.step_sums`)."""
    with tempfile.TemporaryDirectory() as tmp:
        old = {r["q"]: r["abs"] for r in rows_of(before, _exact_copy(ref_dir, Path(tmp)))}
    here = Path(__file__).resolve().parents[3]  # the checkout holding eval/results/<study>/run.py
    after, in_order = rows_of(here, ref_dir, _FIDELITY), rows_of(here, ref_dir, _FIDELITY, "in_order")
    plain = {r["quantity"]: r for r in in_order["rows"]}
    out = []
    for r in after["rows"]:
        bound = max(r["tol"], after["factor"] * r["theirs"])
        fed = any(k.removeprefix("vl_") in r["quantity"] for k in _INPUTS)  # before compared the float32 input
        out.append(dict(quantity=r["quantity"], tol=r["tol"], theirs=r["theirs"], theirs_rms=r["theirs_rms"], bound=bound,
                        before=None if fed else old.get(r["quantity"]), after=r["ours"], after_rms=r["ours_rms"],
                        layers=r["layers"], in_order_layers=plain[r["quantity"]]["layers"], ok=r["ours"] <= bound))
    return dict(step_sums=after["step_sums"], factor=after["factor"], rows=out)


def _over(a: float | None, b: float) -> str:
    return "-" if a is None else (f"{a / b:.2f}" if b else ("0" if a == 0 else "inf"))


def exact_table(result: dict) -> str:
    """Markdown: per quantity the errors against the float64 reference, ours / transformers' before and after
    (max, and rms after), the worst layer after, and whether `after` is within max(tolerance, factor x
    transformers'); then, per layer of the states after decoding, rms ours / theirs with in-order and with the
    reference's decode-step sums."""
    lines = ["| quantity | bound | transformers f32 | ours before | ours after | before / theirs | after / theirs | "
             "rms after / theirs | worst layer after / theirs | result |", "|---" * 10 + "|"]
    for r in result["rows"]:
        worst = max(range(len(r["layers"])), key=lambda i: r["layers"][i][0] / max(r["layers"][i][1], 1e-30), default=None)
        cell = "-" if worst is None else f"{_over(*r['layers'][worst][:2])} (layer {worst})"
        before = "-" if r["before"] is None else f"{r['before']:.3g}"
        lines.append(f"| {r['quantity']} | {r['bound']:.3g} | {r['theirs']:.3g} | {before} | {r['after']:.3g} | "
                     f"{_over(r['before'], r['theirs'])} | {_over(r['after'], r['theirs'])} | "
                     f"{_over(r['after_rms'], r['theirs_rms'])} | {cell} | {'PASS' if r['ok'] else 'FAIL'} |")
    decoded = [r for r in result["rows"] if r["quantity"].endswith("after decoding")]
    if decoded:
        n = len(decoded[0]["layers"])
        lines += ["", f"Per linear layer after decoding, rms ours / theirs: in_order -> {result['step_sums']}", "",
                  "| quantity | " + " | ".join(f"layer {i}" for i in range(n)) + " |", "|---" * (n + 1) + "|"]
        for r in decoded:
            cells = [f"{_over(p[2], p[3])} -> {_over(q[2], q[3])}" for p, q in zip(r["in_order_layers"], r["layers"])]
            lines.append(f"| {r['quantity']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_exact(before: Path, ref_dir: Path, out: Path) -> dict:
    """Measures `exact_rows` and writes OUT/results.json and OUT/table.md (the table under the machine line)."""
    load0, t0 = os.getloadavg(), time.time()
    result = exact_rows(before, ref_dir)
    env = dict(machine=platform.platform(), cpu_count=os.cpu_count(), xla_flags=os.environ.get("XLA_FLAGS", ""),
               loadavg_start=load0, loadavg_end=os.getloadavg(), seconds=round(time.time() - t0, 1),
               timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), before=str(before), fixture=str(ref_dir))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(environment=env, **result), indent=1) + "\n")
    (out / "table.md").write_text(f"Machine: {json.dumps(env)}\n\n{exact_table(result)}\n")
    return result


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
    ap = argparse.ArgumentParser(prog="python -m eval.results.qwen35_precision.run", description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    ap.add_argument("--summary", action="store_true", help="one row per directory instead of a table each")
    ap.add_argument("--exact", type=Path, metavar="OUT_DIR", help="against DIR/reference_f64.npz; results into OUT_DIR")
    ap.add_argument("dirs", type=Path, nargs="+", help="Qwen3.5 reference directories")
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parents[3]  # the checkout holding eval/results/<study>/run.py
    if args.exact is not None:
        if len(args.dirs) != 1 or not (args.dirs[0] / "reference_f64.npz").is_file():
            ap.error("--exact takes one directory holding reference_f64.npz")
        print(exact_table(write_exact(args.before.resolve(), args.dirs[0].resolve(), args.exact)))
        return 0
    if args.summary:
        print("| directory | " + " | ".join(k for k, _ in _KINDS) + " | failed |")
        print("|---" * (len(_KINDS) + 2) + "|")
    for d in args.dirs:
        before, after = rows_of(args.before.resolve(), d.resolve()), rows_of(here, d.resolve())
        print(summary_row(d.name, before, after) if args.summary else table(d.name, before, after) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
