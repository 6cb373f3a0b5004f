"""One call from an annotations folder and a LIBERO HDF5 folder to OxyGen's three frame sets: the training
side (sampled task/target-balanced), the whole held-out side (teacher-forced token accuracy) and the greedy
evaluation frames (10 per task: the reported exact match)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from training.data.oxygen_libero.hdf5 import LiberoHdf5, OxygenLiberoSource, check_hdf5_files
from training.data.oxygen_libero.sampling import EVAL_PER_TASK, select_eval_frames
from training.data.oxygen_libero.split import HELDOUT_PER_TASK, SEED, STRIDE, Split, build_split


@dataclasses.dataclass(frozen=True)
class OxygenLibero:
    """The split and its frame sources (all reading through one `LiberoHdf5`).

    Attributes:
      split: the `Split` (frame references and manifest).
      train: the kept frames of the training demonstrations.
      heldout: the kept frames of the held-out demonstrations.
      eval: `heldout` frames chosen by `select_eval_frames`, in that order.
      eval_indices: their indices into `heldout`.
    """

    split: Split
    train: OxygenLiberoSource
    heldout: OxygenLiberoSource
    eval: OxygenLiberoSource
    eval_indices: list[int]

    def close(self) -> None:
        self.train.reader.close()


def open_oxygen_libero(annotations: str | Path, hdf5_root: str | Path, *, seed: int = SEED,
                       heldout_per_task: int = HELDOUT_PER_TASK, stride: int = STRIDE,
                       eval_per_task: int = EVAL_PER_TASK, eval_seed: int = SEED,
                       target: str | None = None) -> OxygenLibero:
    """OxyGen's split of `annotations` over the raw HDF5 files in `hdf5_root`, with their evaluation frames.

    Args:
      seed, heldout_per_task, stride: the split (their defaults 7, 5, 8).
      eval_per_task, eval_seed: the greedy-evaluation frames (their reported run: 10 per task, seed 7).
      target: the annotation `language` field to predict (None: the memory field, either name).
    Raises:
      FileNotFoundError naming a missing folder or HDF5 file; ValueError naming a malformed annotation row.
    """
    split = build_split(annotations, seed=seed, heldout_per_task=heldout_per_task, stride=stride, target=target)
    check_hdf5_files(hdf5_root, split.train + split.heldout)
    reader = LiberoHdf5(hdf5_root)
    picks = select_eval_frames(split.heldout, per_task=eval_per_task, seed=eval_seed)
    return OxygenLibero(split=split, train=OxygenLiberoSource(split.train, reader),
                        heldout=OxygenLiberoSource(split.heldout, reader),
                        eval=OxygenLiberoSource([split.heldout[i] for i in picks], reader), eval_indices=picks)
