"""How memory frames become training and evaluation batches: the suffix task (`TextTask`), the batch of
every step as a pure function of (seed, step) (`StepBatches`), image augmentation and in-order batches; a
source's read errors as one-line `DataError`s (`CheckedSource`) and the digest of the data a run trains on
(`data_digest`, agreed by every process of a multi-process run).

Axes (`oxygen_jax.axes`): B batch rows, T suffix tokens, Px image side; frames are `training.data.frames` dicts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from oxygen_jax.models.pi05.config import ModelConfig

from oxygen_jax.robots.config import RobotConfig
from oxygen_jax.robots.io import RobotIO
from oxygen_jax.robots.tokenizer import Tokenizer, encode_suffix_prompt
from training.data.frames import MemoryBatch, epoch_batches, frame_texts, make_memory_batch

_HASHED_FILE = 64 << 10  # files of the data folder hashed whole (metadata); larger ones by name and size
_MAX_LISTED = 1 << 20  # files listed for the digest (a larger folder is refused: not a dataset this reads)


class DataError(ValueError):
    """A frame of the data could not be read or is invalid (one line naming the split, frame, file and field)."""


class CheckedSource(Sequence):
    """`source` (frames by index) whose read errors, found whenever a frame is read, become one `DataError`
    naming the split and the frame; every other attribute (e.g. `batch_indices`) is the source's."""

    def __init__(self, source: Sequence[Mapping], split: str):
        self.source, self.split = source, split

    def __len__(self) -> int:
        return len(self.source)

    def _call(self, read, k: int):
        try:
            return read(k)
        except (ValueError, OSError) as e:
            raise DataError(f"split {self.split!r} frame {k}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                            ) from None

    def __getitem__(self, k: int) -> dict:
        return self._call(self.source.__getitem__, k)

    def texts(self, k: int) -> dict:
        return self._call(getattr(self.source, "texts", None) or self.source.__getitem__, k)

    def __getattr__(self, name: str):
        if name == "source":  # not yet set (copying)
            raise AttributeError(name)
        return getattr(self.source, name)


def _listing(path: Path, h) -> None:
    """Relative path and size of every file under `path` (and the bytes of small ones) into the hash `h`."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    if len(files) > _MAX_LISTED:
        raise DataError(f"{root}: more than {_MAX_LISTED} files; point --data at one dataset")
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(root).as_posix() if f != root else f.name}\0{size}\0".encode())
        if size <= _HASHED_FILE:
            h.update(hashlib.sha256(f.read_bytes()).digest())


def data_digest(folders: Sequence[str | os.PathLike], splits: Mapping[str, Sequence[Mapping]], label_key: str) -> str:
    """SHA-256 of what a run trains and evaluates on: the file listing of each data folder (relative paths and
    sizes, small files' bytes; not where the folder is), and per split its length, its label table (every
    frame's `label_key` and instruction) and, where the split says, its episodes and frames
    (`digest_parts()`, e.g. LeRobot splits). Equal on every process of a run that reads the same data."""
    h = hashlib.sha256()
    for folder in folders:
        _listing(Path(folder), h)
    for name in sorted(splits):
        source = splits[name]
        parts = source.digest_parts() if hasattr(source, "digest_parts") else {
            "labels": [[f.get(label_key), f.get("language_instruction")]
                       for f in frame_texts(source, (label_key, "language_instruction"))]}
        h.update(json.dumps({"split": name, "frames": len(source), **parts}, sort_keys=True, default=str).encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class TextTask:
    """How frames become batches: the robot's observation transform, tokenizer and suffix task."""

    robot: RobotConfig
    tokenizer: Tokenizer
    prompt: str
    label_key: str
    suffix_len: int
    io: RobotIO | None = None  # the base checkpoint's robot I/O (`ckpts.load.LoadedModel.io`); None: openpi's

    def batch(self, frames: Sequence[Mapping], model_config: ModelConfig) -> MemoryBatch:
        return make_memory_batch(frames, self.robot, model_config, self.tokenizer, suffix_len=self.suffix_len,
                                 prompt=self.prompt, label_key=self.label_key, io=self.io)

    @property
    def prompt_ids(self) -> list[int]:
        return encode_suffix_prompt(self.tokenizer, self.prompt)


class StepBatches:
    """The batch of every step as a pure function of (seed, step): epoch = step // batches per epoch, rows from
    `epoch_batches(..., seed, epoch)` (full batches only), unless the source draws its own rows with a
    `batch_indices(step, batch_size, seed)` method (OxyGen's balanced sampler, `training.data.oxygen_libero`). Resuming
    at any step needs no iterator state.

    `rows` = (start, stop): materialise only those rows of every global batch (one process's share,
    `training.distributed.process_rows`); which frames they are and how they are augmented does not depend on
    the number of processes. `frames_decoded` counts the frames read from the source so far."""

    def __init__(self, source: Sequence[Mapping], task: TextTask, model_config: ModelConfig, *, batch_size: int,
                 seed: int, augment: float = 0.0, rows: tuple[int, int] | None = None):
        self.source, self.task, self.model_config = source, task, model_config
        self.batch_size, self.seed, self.augment = batch_size, seed, augment
        self.rows = (0, batch_size) if rows is None else rows
        if not 0 <= self.rows[0] < self.rows[1] <= batch_size:
            raise ValueError(f"StepBatches.rows must be a non-empty range within [0, {batch_size}), got {rows}")
        self.frames_decoded = 0
        self.per_epoch = len(source) // batch_size
        if self.per_epoch == 0:
            raise ValueError(f"the training split has {len(source)} frames, fewer than batch_size={batch_size}")
        self._epoch: tuple[int, list[np.ndarray]] | None = None

    def indices(self, step: int) -> np.ndarray:
        if hasattr(self.source, "batch_indices"):  # a source with its own sampler (training.data.oxygen_libero)
            return self.source.batch_indices(int(step), self.batch_size, self.seed)
        epoch, i = divmod(int(step), self.per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_batches(len(self.source), batch_size=self.batch_size, seed=self.seed,
                                                epoch=epoch))
        return self._epoch[1][i]

    def __call__(self, step: int) -> MemoryBatch:
        """The rows `self.rows` of step `step`'s batch."""
        start, stop = self.rows
        idx = self.indices(step)[start:stop]
        frames = [self.source[int(i)] for i in idx]
        self.frames_decoded += len(frames)
        if self.augment:  # drawn per global row: the same pixels whatever the process layout
            frames = [augment_frame(f, self.augment, np.random.default_rng([self.seed, int(step), start + r]))
                      for r, f in enumerate(frames)]
        try:
            return self.task.batch(frames, self.model_config)
        except (ValueError, KeyError) as e:
            raise ValueError(f"step {step}, frames {idx.tolist()}: {e}") from e


def augment_frame(frame: Mapping, strength: float, rng: np.random.Generator) -> dict:
    """A copy of `frame` whose camera images are shifted (edge-padded, up to `strength` of the side in each
    direction) and brightness-scaled by a factor in [1 - strength, 1 + strength], independently per camera."""
    out = dict(frame)
    for key in ("image", "wrist_image"):
        img = np.asarray(frame[key])
        h, w = img.shape[:2]
        m = int(round(strength * min(h, w)))
        dy, dx = rng.integers(0, 2 * m + 1, 2)
        padded = np.pad(img, ((m, m), (m, m), (0, 0)), mode="edge")
        crop = padded[dy:dy + h, dx:dx + w].astype(np.float32) * rng.uniform(1 - strength, 1 + strength)
        out[key] = np.clip(np.round(crop), 0, 255).astype(np.uint8)
    return out


def fixed_batches(source: Sequence[Mapping], task: TextTask, model_config: ModelConfig, batch_size: int,
                  limit: int | None = None) -> list[tuple[MemoryBatch, int]]:
    """In-order batches of the first `limit` frames (all by default): [(batch, real rows)], the last one padded
    with copies of its first frame (their loss mask is all False)."""
    n = len(source) if limit is None else min(limit, len(source))
    out = []
    for start in range(0, n, batch_size):
        frames = [source[i] for i in range(start, min(start + batch_size, n))]
        real = len(frames)
        frames += [frames[0]] * (batch_size - real)
        batch = task.batch(frames, model_config)
        if real < batch_size:
            mask = batch.loss_mask.copy()
            mask[real:] = False
            batch = dataclasses.replace(batch, loss_mask=mask)
        out.append((batch, real))
    return out


def task_texts(source: Sequence[Mapping], keys: Sequence[str] = ("language_instruction", "memory", "scene")) -> list[str]:
    """Distinct texts of the given frame keys (those present), in first-seen order: a tokenizer corpus."""
    seen: dict[str, None] = {}
    for frame in frame_texts(source, keys):  # no image decoding
        for k in keys:
            if k in frame:
                seen.setdefault(str(frame[k]), None)
    return list(seen)
