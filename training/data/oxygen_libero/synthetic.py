"""Small LIBERO-layout HDF5 files and OxyGen-schema annotation JSONL written from the documented layouts (see
`hdf5` and `annotations`), for tests and for trying the commands without the real data.

Every frame's pixels encode where they come from (`frame_pixels`), so a reader's rotation and indexing can be
checked; the memory text of a demonstration changes at given frames, as OxyGen's labels do when a goal
predicate has held for a few frames.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

NO_PROGRESS = "No relevant task progress is visible yet."


def frame_pixels(task_id: int, k: int, frame: int, camera: int, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: an asymmetric ramp offset by (task, demo, frame, camera), as stored (unrotated)."""
    y, x = np.mgrid[0:size, 0:size]
    base = 7 * y + 3 * x + 11 * frame + 29 * k + 53 * task_id + 97 * camera
    return (np.stack([base, base * 2 + 1, base * 5 + 2], -1) % 256).astype(np.uint8)


def memory_texts(length: int, changes: Sequence[int], facts: Sequence[str]) -> list[str]:
    """Per frame: NO_PROGRESS, then after each change frame one more fact, joined with "; " and ended with "."."""
    out = []
    for t in range(length):
        text = "; ".join(f for c, f in zip(changes, facts) if t >= c)
        out.append(text[0].upper() + text[1:] + "." if text else NO_PROGRESS)
    return out


def write_task(hdf5_root: str | Path, annotations_root: str | Path, *, suite: str, task: str, instruction: str,
               task_id: int, lengths: Sequence[int], changes: Mapping[int, Sequence[int]] | None = None,
               facts: Sequence[str] = ("the black bowl is on the plate", "the top drawer of the cabinet is closed"),
               target_name: str = "textual_memory", image_size: int = 16) -> Path:
    """Writes `<hdf5_root>/<suite>/<task>_demo.hdf5` with demo_0 … demo_{n-1} of the given lengths and one
    annotation file per demo under `<annotations_root>/<suite>/<task>/`; returns the HDF5 path.

    Args:
      changes: {k: frames where demo k's memory gains the next fact} (default: a third and two thirds in).
      target_name: the row's memory field name ("textual_memory" or "visual_memory").
    """
    import h5py

    path = Path(hdf5_root) / suite / f"{task}_demo.hdf5"
    path.parent.mkdir(parents=True, exist_ok=True)
    ann = Path(annotations_root) / suite / task
    ann.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["problem_info"] = json.dumps({"problem_name": task, "language_instruction": instruction})
        for k, n in enumerate(lengths):
            demo = data.create_group(f"demo_{k}")
            demo.create_dataset("actions", data=np.zeros((n, 7), np.float64))
            obs = demo.create_group("obs")
            for camera, key in enumerate(("agentview_rgb", "eye_in_hand_rgb")):
                obs.create_dataset(key, data=np.stack([frame_pixels(task_id, k, t, camera, image_size) for t in range(n)]))
            t = np.arange(n, dtype=np.float64)[:, None]
            obs.create_dataset("ee_states", data=t * 0.01 + np.arange(6) + k)
            obs.create_dataset("gripper_states", data=np.concatenate([t * -0.001, t * 0.001], 1))
            at = (changes or {}).get(k, (n // 3, 2 * n // 3))
            texts = memory_texts(n, at, facts)
            with open(ann / f"demo_{k}.jsonl", "w") as rows:
                for i, text in enumerate(texts):
                    row = {"dataset": path.name, "demo": f"demo_{k}", "frame": i, "suite": suite, "task": task,
                           "task_instruction": instruction, "annotation_mode": "recorded-states",
                           "goal_predicates": [], "auxiliary_predicates": [], "success": False,
                           "language": {"completed": "", "remaining": "", "next": "", target_name: text}}
                    rows.write(json.dumps(row) + "\n")
    return path
