"""A run's frames as a tfds dataset (`export_tfds`), through `training.data.frames.write_memory_dataset`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from training.data.libero.shards import iter_frames, read_jsonl


def _tfds_frames(run_dir: Path, split: str, suite: str) -> Iterator[dict]:
    """A run's frames in `training.data.frames`'s frame format (structured fields as JSON strings)."""
    for f in iter_frames(run_dir, split=split):
        yield {
            "image": f["image"], "wrist_image": f["wrist_image"], "state": f["state"],
            "language_instruction": f["language_instruction"], "memory": f["memory"], "task": f["task_name"],
            "init_index": f["init_index"], "scene": f["scene"], "suite": suite, "task_id": f["task"],
            "frame_key": f["key"], "placed": json.dumps(f["placed"]), "predicates": json.dumps(f["predicates"]),
        }


def export_tfds(run_dir: str | Path, out_dir: str | Path, *, name: str = "libero_memory") -> Path:
    """Convert a run's shards with `training.data.frames.write_memory_dataset` (splits "train", "heldout";
    replaces an earlier export). Returns the dataset version folder."""
    try:
        from training.data.frames import write_memory_dataset
    except ImportError as err:
        raise SystemExit(
            f"--export-tfds needs training.data.frames.write_memory_dataset and its requirements ({err})"
        ) from None
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    rows = read_jsonl(run_dir / "index.jsonl")
    present = {r["split"] for r in rows}
    splits = {s: _tfds_frames(run_dir, s, config["suite"]) for s in ("train", "heldout") if s in present}
    if not splits:
        raise SystemExit(f"no frames in {run_dir} to export; generate some first")
    return write_memory_dataset(out_dir, splits, image_size=config["image_size"], name=name,
                                jpeg_quality=config["jpeg_quality"], overwrite=True)
