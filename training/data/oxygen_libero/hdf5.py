"""Frames of LIBERO's raw HDF5 demonstrations (the official `<suite>/<task>_demo.hdf5` files), read one frame at a
time with h5py, as OxyGen builds them.

File layout (what is read):

    <hdf5 root>/<suite>/<task>_demo.hdf5
      data/                      attribute problem_info: JSON with "language_instruction"
        demo_<k>/actions         [n, 7]            (its length bounds the frame index)
        demo_<k>/obs/agentview_rgb    uint8 [n, H, W, 3]
        demo_<k>/obs/eye_in_hand_rgb  uint8 [n, H, W, 3]
        demo_<k>/obs/ee_states        [n, 6]
        demo_<k>/obs/gripper_states   [n, 2]

A frame (`training.data.frames`'s frame dict) is built like OxyGen's dataset item:

    image       = agentview_rgb[frame][::-1, ::-1]       (rotated 180°: LIBERO renders upside down)
    wrist_image = eye_in_hand_rgb[frame][::-1, ::-1]
    state       = float32 concat(ee_states[frame], gripper_states[frame])     [8] in LIBERO
    language_instruction = the annotation row's task_instruction

plus the target text under "memory" and under both of its OxyGen names ("textual_memory", "visual_memory"),
so any of them can be the trainer's label key, and metadata: task, suite, demo, frame, init_index (= k).
Only the requested frame's arrays are read; files stay open (one handle per file) until `close`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from training.data.oxygen_libero.annotations import MEMORY_TARGETS, FrameRef
from training.data.oxygen_libero.sampling import BalancedSampler


def hdf5_path(root: str | Path, suite: str, task: str) -> Path:
    return Path(root) / suite / f"{task}_demo.hdf5"


def check_hdf5_files(root: str | Path, refs: Sequence[FrameRef]) -> None:
    """Raises FileNotFoundError naming the first task whose HDF5 file is missing under `root`."""
    for suite, task in dict.fromkeys(r.task_key for r in refs):
        path = hdf5_path(root, suite, task)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing LIBERO demonstration file for {suite}/{task}; pass the folder "
                                    "holding LIBERO's <suite>/<task>_demo.hdf5 files (their raw release, not a LeRobot copy)")


class LiberoHdf5:
    """Reads single frames of the raw HDF5 files under `root` (module docstring); not thread-safe."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._files: dict[Path, object] = {}

    def _file(self, path: Path):
        if path not in self._files:
            import h5py  # only readers of raw LIBERO files need it

            self._files[path] = h5py.File(path, "r")
        return self._files[path]

    def observation(self, ref: FrameRef) -> dict:
        """{"image", "wrist_image": uint8 [H, W, 3] rotated 180°, "state": float32 [Ds]} of one frame."""
        path = hdf5_path(self.root, ref.suite, ref.task)
        f = self._file(path)
        group = f"data/{ref.demo}"
        if group not in f:
            raise KeyError(f"{path}: no group {group}; the annotations and the HDF5 files are of different releases")
        demo = f[group]
        n = len(demo["actions"])
        if not 0 <= ref.frame < n:
            raise IndexError(f"{path} {group}: frame {ref.frame} is outside its {n} frames")
        obs = demo["obs"]
        return {
            "image": np.ascontiguousarray(obs["agentview_rgb"][ref.frame][::-1, ::-1]),
            "wrist_image": np.ascontiguousarray(obs["eye_in_hand_rgb"][ref.frame][::-1, ::-1]),
            "state": np.concatenate([obs["ee_states"][ref.frame], obs["gripper_states"][ref.frame]]).astype(np.float32),
        }

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class OxygenLiberoSource(Sequence):
    """Random access to the frames of a list of `FrameRef`s: `src[i]` reads frame i from the HDF5 files,
    `src.texts(i)` gives its text fields without touching them.

    `batch_indices(step, batch_size, seed)` is OxyGen's task/target-balanced draw of that step
    (`sampling.BalancedSampler`), which `training.memory.data.StepBatches` uses in place of shuffled epochs.
    """

    def __init__(self, refs: Sequence[FrameRef], reader: LiberoHdf5):
        self.refs = list(refs)
        self.reader = reader
        self._sampler: BalancedSampler | None = None

    def __len__(self) -> int:
        return len(self.refs)

    def texts(self, i: int) -> dict:
        ref = self.refs[i]
        labels = dict.fromkeys(("memory", *MEMORY_TARGETS), ref.target)
        return {"language_instruction": ref.instruction, **labels, "task": ref.task, "suite": ref.suite,
                "demo": ref.demo, "frame": ref.frame, "init_index": ref.demo_index}

    def __getitem__(self, i: int) -> dict:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"frame index must be an int, got {type(i).__name__}")
        return {**self.reader.observation(self.refs[i]), **self.texts(int(i))}

    def batch_indices(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        if self._sampler is None or self._sampler.seed != seed:
            self._sampler = BalancedSampler(self.refs, seed)
        return self._sampler.batch(step, batch_size)
