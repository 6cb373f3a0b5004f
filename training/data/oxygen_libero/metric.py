"""OxyGen's text metric: greedy exact match after `normalize`, and a bag-of-words F1 on the same normal form.

    normalize(s) = re.sub(r"\\s+", " ", s.strip().lower()).rstrip(".")

i.e. strip, lower-case, collapse every whitespace run to one space, then drop the trailing periods (all of
them: "done.." → "done"; a space before them stays: "done ." → "done "). This differs from
`oxygen_jax.demo.normalize_answer` (case-fold, one optional period), so the number is comparable to theirs.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence

_SPACES = re.compile(r"\s+")


def normalize(text: str) -> str:
    """OxyGen's normal form (module docstring). Example: "  The bowl\\n is on  the plate.  " → "the bowl is on the plate"."""
    return _SPACES.sub(" ", text.strip().lower()).rstrip(".")


def exact_match(prediction: str, target: str) -> bool:
    return normalize(prediction) == normalize(target)


def word_f1(prediction: str, target: str) -> float:
    """Bag-of-words F1 of the normalised texts (clipped counts); 1.0 when both are empty, 0.0 when one is."""
    p, t = normalize(prediction).split(), normalize(target).split()
    if not p or not t:
        return float(p == t)
    overlap = sum((collections.Counter(p) & collections.Counter(t)).values())
    if not overlap:
        return 0.0
    precision, recall = overlap / len(p), overlap / len(t)
    return 2 * precision * recall / (precision + recall)


def oxygen_metrics(predictions: Sequence[str], targets: Sequence[str]) -> dict:
    """{"n", "normalized_exact", "word_f1"}: means over the frames (OxyGen's summary figures)."""
    if len(predictions) != len(targets) or not targets:
        raise ValueError(f"need as many predictions as targets (> 0), got {len(predictions)} and {len(targets)}")
    exact = [exact_match(p, t) for p, t in zip(predictions, targets)]
    f1 = [word_f1(p, t) for p, t in zip(predictions, targets)]
    return {"n": len(targets), "normalized_exact": sum(exact) / len(exact), "word_f1": sum(f1) / len(f1)}
