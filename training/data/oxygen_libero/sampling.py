"""OxyGen's two ways of picking frames from a split, with their random draws made in the same order:

* `BalancedSampler` (training, "task_target_balanced"): each row of each batch draws a task uniformly (tasks
  sorted), then a target text uniformly among that task's distinct targets (sorted), then a frame uniformly
  among that target's frames, from one `np.random.default_rng(seed)` stream:

      task   = tasks[rng.integers(0, len(tasks))]
      target = targets[task][rng.integers(0, len(targets[task]))]
      frame  = frames[task][target][rng.integers(0, len(frames[task][target]))]

  Batch s (0-based) is draws s·B … s·B + B − 1 of that stream.
* `select_eval_frames` (greedy evaluation, 10 frames per task for the reported number): one
  `np.random.default_rng(seed)` for all tasks, tasks in split order; per task, one random frame of every
  distinct target (targets in first-seen order), shuffled; if that is fewer than `per_task`, the task's other
  frames are shuffled and appended; the first `per_task` are kept.

Frames are indices into the split's `FrameRef` list; the draws depend on (task, target, order) only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from training.data.oxygen_libero.annotations import FrameRef

EVAL_PER_TASK = 10


def _by_task_and_target(refs: Sequence[FrameRef]) -> dict[tuple[str, str], dict[str, list[int]]]:
    """{task: {target: [indices]}}, tasks and targets in first-seen order."""
    grouped: dict[tuple[str, str], dict[str, list[int]]] = {}
    for i, ref in enumerate(refs):
        grouped.setdefault(ref.task_key, {}).setdefault(ref.target, []).append(i)
    return grouped


class BalancedSampler:
    """Task → target → frame uniform draws (module docstring); `batch(step, B)` is a pure function of (seed, step)
    (the stream is replayed from its start when needed, so resuming at any step needs no saved state)."""

    def __init__(self, refs: Sequence[FrameRef], seed: int):
        if not refs:
            raise ValueError("BalancedSampler: the split has no frames to sample")
        self._groups = _by_task_and_target(refs)
        self._tasks = sorted(self._groups)
        self._targets = {task: sorted(self._groups[task]) for task in self._tasks}
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._drawn: list[int] = []

    def _draw(self) -> int:
        task = self._tasks[int(self._rng.integers(0, len(self._tasks)))]
        targets = self._targets[task]
        target = targets[int(self._rng.integers(0, len(targets)))]
        frames = self._groups[task][target]
        return frames[int(self._rng.integers(0, len(frames)))]

    def draws(self, n: int) -> list[int]:
        """The first `n` frame indices of the stream."""
        while len(self._drawn) < n:
            self._drawn.append(self._draw())
        return self._drawn[:n]

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        """int64 [B]: the frame indices of 0-based step `step` (OxyGen's step `step + 1`)."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"need step >= 0 and batch_size >= 1, got {step} and {batch_size}")
        return np.asarray(self.draws((step + 1) * batch_size)[step * batch_size:], np.int64)


def select_eval_frames(refs: Sequence[FrameRef], *, per_task: int = EVAL_PER_TASK, seed: int = 7) -> list[int]:
    """The greedy-evaluation frames (module docstring): indices into `refs`, task by task."""
    if per_task < 1:
        raise ValueError(f"per_task must be >= 1, got {per_task}")
    rng = np.random.default_rng(seed)
    selected: list[int] = []
    for targets in _by_task_and_target(refs).values():
        candidates = [frames[int(rng.integers(0, len(frames)))] for frames in targets.values()]
        rng.shuffle(candidates)  # a Python list, as theirs: the same swaps as for an array
        if len(candidates) < per_task:
            chosen = set(candidates)
            remaining = [i for i in _task_order(targets) if i not in chosen]
            rng.shuffle(remaining)
            candidates.extend(remaining[: per_task - len(candidates)])
        selected.extend(candidates[:per_task])
    return selected


def _task_order(targets: dict[str, list[int]]) -> list[int]:
    """A task's frame indices in split order (they are ascending within the task)."""
    return sorted(i for frames in targets.values() for i in frames)
