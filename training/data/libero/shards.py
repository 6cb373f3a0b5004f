"""A run's storage: npz shards of accepted frames (`ShardWriter`, read back by `iter_frames`) and the
JSON-lines logs beside them (`index.jsonl`, `rejected.jsonl`).

A shard is written atomically before its index lines, so a crash loses at most one shard; a writer
started on a crashed run deletes shards that were never indexed and the cut last line of a log.
"""

from __future__ import annotations

import collections
import io
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from oxygen_jax.robots.libero import CAMERAS
from training.data.libero.config import GenConfig


def _encode(image: np.ndarray, fmt: str, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    else:
        Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _decode(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines log; [] when it does not exist, and a line cut by a crash is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash
            continue
    return rows


def _repair_jsonl(path: Path) -> None:
    """Drop a last line cut by a crash (no trailing newline), so appends start on a fresh line."""
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)


def append_jsonl(path: Path, rows: Sequence[dict]) -> None:
    """Append rows as JSON lines and fsync, so a logged row survives a crash."""
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


class ShardWriter:
    """Buffers accepted frames; each flush writes one npz shard atomically, then its index lines."""

    def __init__(self, run_dir: Path, cfg: GenConfig):
        self.run_dir, self.cfg = run_dir, cfg
        (run_dir / "shards").mkdir(parents=True, exist_ok=True)
        for log in ("index.jsonl", "rejected.jsonl"):
            _repair_jsonl(run_dir / log)
        indexed = {r["shard"] for r in read_jsonl(run_dir / "index.jsonl")}
        for path in (run_dir / "shards").glob("shard_*.npz"):  # written but never indexed: a crash
            if path.name not in indexed:
                path.unlink()
        for path in (run_dir / "shards").glob("*.tmp.npz"):
            path.unlink()
        existing = [int(p.stem.split("_")[1]) for p in (run_dir / "shards").glob("shard_*.npz")]
        self.next_shard = max(existing, default=-1) + 1
        self.rows: list[dict] = []
        self.images: dict[str, list[bytes]] = {k: [] for k in CAMERAS}
        self.states: list[np.ndarray] = []

    def add(self, row: dict, images: dict[str, np.ndarray], state: np.ndarray) -> None:
        """Encode and buffer one frame (its encode time goes into row["timings"]); flush a full shard."""
        t0 = time.perf_counter()
        for k in CAMERAS:
            self.images[k].append(_encode(images[k], self.cfg.image_format, self.cfg.jpeg_quality))
        row["timings"]["encode_s"] = round(time.perf_counter() - t0, 4)
        self.rows.append(row)
        self.states.append(state)
        if len(self.rows) >= self.cfg.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        name = f"shard_{self.next_shard:05d}.npz"
        arrays = {"state": np.stack(self.states), "key": np.array([r["key"] for r in self.rows])}
        for k, blobs in self.images.items():
            arrays[k] = np.frombuffer(b"".join(blobs), np.uint8)
            arrays[k + "_offsets"] = np.cumsum([0] + [len(b) for b in blobs]).astype(np.int64)
        tmp = self.run_dir / "shards" / f"{name[:-4]}.tmp.npz"
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, self.run_dir / "shards" / name)
        append_jsonl(self.run_dir / "index.jsonl", [dict(r, shard=name, row=i) for i, r in enumerate(self.rows)])
        self.next_shard += 1
        self.rows, self.states = [], []
        self.images = {k: [] for k in CAMERAS}


def iter_frames(run_dir: str | Path, split: str | None = None) -> Iterator[dict]:
    """Accepted frames of a run as dicts: the index row plus "image", "wrist_image" (uint8 [H, W, 3]) and
    "state" (float32 [8])."""
    run_dir = Path(run_dir)
    rows = [r for r in read_jsonl(run_dir / "index.jsonl") if split is None or r["split"] == split]
    by_shard: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_shard[r["shard"]].append(r)
    for shard, shard_rows in sorted(by_shard.items()):
        with np.load(run_dir / "shards" / shard) as z:
            arrays = {k: z[k] for k in z.files}
        for r in shard_rows:
            i = r["row"]
            frame = dict(r, state=arrays["state"][i])
            for k in CAMERAS:
                lo, hi = arrays[k + "_offsets"][i : i + 2]
                frame[k] = _decode(arrays[k][lo:hi].tobytes())
            yield frame
