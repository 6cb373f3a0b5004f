"""Comparison rows shared by the parity checks: one `Row` per quantity, a `Checker` that makes them, one table.

A float quantity passes when max|ours - ref| <= atol + rtol * max|ref| (rtol None: an absolute test,
max|ours - ref| <= atol); an integer or boolean quantity must match exactly, and its `max_abs` is the number
of mismatches. A shape mismatch fails either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass
class Row:
    quantity: str
    layout: str | None  # the checkpoint layout compared (openpi fixtures hold several), or None
    max_abs: float  # max |ours - ref|, or the number of mismatches for exact quantities
    max_rel: float  # max_abs / max|ref| (exact quantities: mismatches / elements)
    tol: str
    ok: bool


Tolerance = Callable[[str, str | None], tuple[float, float | None]]
"""(quantity, family) -> (atol, rtol); rtol None is an absolute test (see the module docstring)."""


class Checker:
    """Compares our arrays with reference arrays and keeps one `Row` each, in order."""

    def __init__(self, tolerance: Tolerance, layout: str | None = None):
        self.tolerance, self.layout, self.rows = tolerance, layout, []

    def add(self, quantity: str, max_abs: float, max_rel: float, tol: str, ok: bool) -> None:
        """A row computed by the caller (e.g. a check between two of our own results)."""
        self.rows.append(Row(quantity, self.layout, max_abs, max_rel, tol, ok))

    def close(self, name: str, ours, ref, family: str | None = None, valid=None, like: str | None = None):
        """Compares within the tolerance of `name` (or of the quantity `like`, e.g. the LoRA-free twin).

        `valid` (bool, broadcastable to the leading axes) selects the entries compared.
        """
        ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
        if ours.shape != ref.shape:
            self.add(name, math.inf, math.inf, f"shape {ours.shape} vs {ref.shape}", False)
            return
        if valid is not None:
            ours, ref = ours[valid], ref[valid]
        atol, rtol = self.tolerance(like or name, family)
        d = float(np.max(np.abs(ours - ref))) if ref.size else 0.0
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        bound = atol if rtol is None else atol + rtol * scale
        tol = f"atol {atol:g}" if rtol is None else f"atol {atol:g} rtol {rtol:g}"
        self.add(name, d, d / scale if scale else d, tol, bool(np.isfinite(d) and d <= bound))

    def exact(self, name: str, ours, ref, valid=None):
        ours, ref = np.asarray(ours), np.asarray(ref)
        if ours.shape != ref.shape:
            self.add(name, math.inf, math.inf, f"shape {ours.shape} vs {ref.shape}", False)
            return
        if valid is not None:
            ours, ref = ours[valid], ref[valid]
        d = int(np.sum(ours != ref))
        self.add(name, float(d), d / max(ref.size, 1), "exact (mismatches)", d == 0)


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table; rows that name a layout (openpi) also get the layout and relative-error columns."""
    if any(r.layout is not None for r in rows):
        lines = ["| quantity | layout | max abs err | max abs / max ref | tolerance | result |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {r.quantity} | {r.layout} | {r.max_abs:.3g} | {r.max_rel:.3g} | {r.tol} | {_verdict(r)} |"
                  for r in rows]
    else:
        lines = ["| quantity | max abs err | tolerance | result |", "|---|---|---|---|"]
        lines += [f"| {r.quantity} | {r.max_abs:.3g} | {r.tol} | {_verdict(r)} |" for r in rows]
    return "\n".join(lines)


def _verdict(row: Row) -> str:
    return "PASS" if row.ok else "FAIL"


def summary(rows: Sequence[Row]) -> str:
    """'n/m checks passed', naming every failed quantity."""
    failed = [r for r in rows if not r.ok]
    return f"{len(rows) - len(failed)}/{len(rows)} checks passed" + (
        f"; FAILED: {', '.join(r.quantity for r in failed)}" if failed else "")


def report(rows: Sequence[Row]) -> int:
    """Prints the table and the summary; the command's exit status (0 when every check passed)."""
    print(format_table(rows))
    print("\n" + summary(rows))
    return 0 if all(r.ok for r in rows) else 1
