"""OxyGen's episode split: per task, 5 held-out demonstrations drawn with a per-task seed, and the frames each
demonstration contributes (the first, the last, every 8th, and both sides of every target change).

Per (suite, task), in sorted order, with the demonstrations sorted by k:

    rng = random.Random(int.from_bytes(sha256(f"{seed}:{suite}:{task}").digest()[:8], "little"))
    held_out = rng.sample([demo stems], heldout_per_task)

Kept frames of one demonstration of n frames with targets y[0..n-1]:

    {0, n-1} ∪ {0, stride, 2·stride, ...} ∪ {i, i-1 : y[i] != y[i-1]}            (sorted)

Example (stride 4, n = 10, targets a a a b b b b b c c): {0, 9} ∪ {0, 4, 8} ∪ {2, 3} ∪ {7, 8}
= [0, 2, 3, 4, 7, 8, 9].

With the released annotations (40 tasks × 50 demonstrations, seed 7, 5 held out, stride 8) this holds out 200
demonstrations whose kept frames number 5,082. Frame lists are built one annotation file at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from pathlib import Path

from training.data.oxygen_libero.annotations import FrameRef, annotation_files, read_demo

SEED = 7
HELDOUT_PER_TASK = 5
STRIDE = 8


def task_seed(seed: int, suite: str, task: str) -> int:
    """The per-task seed: the first 8 bytes of sha256("seed:suite:task"), little-endian."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{suite}:{task}".encode()).digest()[:8], "little")


def heldout_demos(demos: Sequence[str], seed: int, suite: str, task: str, count: int) -> list[str]:
    """The held-out demonstration stems of one task, sorted (`demos` in k order, as the draw reads them)."""
    if count > len(demos):
        raise ValueError(f"{suite}/{task}: cannot hold out {count} of {len(demos)} demonstrations; lower heldout_per_task")
    return sorted(random.Random(task_seed(seed, suite, task)).sample(list(demos), count))


def kept_frames(targets: Sequence[str], stride: int) -> list[int]:
    """The frames one demonstration contributes (module docstring), sorted."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    n = len(targets)
    keep = {0, n - 1, *range(0, n, stride)}
    for i in range(1, n):
        if targets[i] != targets[i - 1]:
            keep.update((i - 1, i))
    return sorted(keep)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Split:
    """Kept frames of the training and held-out demonstrations, in (suite, task, k, frame) order.

    Attributes:
      train, heldout: the kept `FrameRef`s of each side.
      heldout_demos: {"suite/task": sorted held-out demo stems}.
      seed, heldout_per_task, stride: what drew it.
      train_demos: how many demonstrations the training side has.
    """

    train: list[FrameRef]
    heldout: list[FrameRef]
    heldout_demos: dict[str, list[str]]
    seed: int
    heldout_per_task: int
    stride: int
    train_demos: int

    def manifest(self) -> dict:
        """Counts and the held-out demonstrations, JSON-able (OxyGen's split manifest fields)."""
        return {"seed": self.seed, "validation_episodes_per_task": self.heldout_per_task,
                "uniform_stride": self.stride, "train_episodes": self.train_demos,
                "validation_episodes": sum(map(len, self.heldout_demos.values())),
                "train_samples": len(self.train), "validation_samples": len(self.heldout),
                "validation_demos": self.heldout_demos}


def build_split(annotations: str | Path, *, seed: int = SEED, heldout_per_task: int = HELDOUT_PER_TASK,
                stride: int = STRIDE, target: str | None = None) -> Split:
    """OxyGen's split of an annotations folder (module docstring); reads the JSONL files only, one at a time.

    Args:
      annotations: the folder holding <suite>/<task>/demo_<k>.jsonl.
      target: the `language` field to predict and to detect changes on (None: the memory field, under either
        of its names).
    """
    train: list[FrameRef] = []
    heldout: list[FrameRef] = []
    held: dict[str, list[str]] = {}
    train_demos = 0
    for (suite, task), paths in annotation_files(annotations).items():
        names = heldout_demos([p.stem for p in paths], seed, suite, task, heldout_per_task)
        held[f"{suite}/{task}"] = names
        for path in paths:
            refs = read_demo(path, suite, task, target)
            keep = kept_frames([r.target for r in refs], stride)
            side = heldout if path.stem in names else train
            train_demos += path.stem not in names
            side.extend(refs[i] for i in keep)
    return Split(train=train, heldout=heldout, heldout_demos=held, seed=seed, heldout_per_task=heldout_per_task,
                 stride=stride, train_demos=train_demos)
