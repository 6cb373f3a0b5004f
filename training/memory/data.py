"""How memory frames become training and evaluation batches: the suffix task (`TextTask`), the batch of
every step as a pure function of (seed, step) (`StepBatches`), image augmentation and in-order batches; a
source's read errors as one-line `DataError`s (`CheckedSource`) and the digest of the data a run trains on
(`data_digest`, agreed by every process of a multi-process run).

Batches (`memory_batches`): B frames → `MemoryBatch(observation, suffix_tokens, suffix_mask, loss_mask)`,
where the observation is built exactly as at serving time (`transforms.make_observation` on LIBERO client
samples) and the suffix is the per-request prompt "Memory: " followed by the label and EOS, padded to a
static length.

Axes (`oxygen_jax.axes`): B batch rows, Nc cameras, Px image side, Tp prompt tokens, T suffix tokens (the query
tokens of the teacher-forced suffix forward), Ds state dims; frames are `training.data.frames` dicts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np

from oxygen_jax.models.pi05.config import ModelConfig
from oxygen_jax.models.pi05.observation import Observation
from oxygen_jax.robots.config import RobotConfig
from oxygen_jax.robots.io import RobotIO, observation_rows
from oxygen_jax.robots.normalize import NormStats
from oxygen_jax.robots.tokenizer import Tokenizer, encode_suffix_prompt
from oxygen_jax.robots.transforms import check_token_ids, make_observation
from training.data.frames import as_text, frame_texts

MEMORY_PROMPT = "Memory: "  # the request prompt of the memory suffix
_BATCH_KEYS = ("image", "wrist_image", "state", "language_instruction")  # the frame fields a batch reads
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MemoryBatch:
    """One training batch for the suffix-only memory loss; every shape is static.

    Attributes:
      observation: the prefix inputs (images float32 [B, Nc, Px, Px, 3], image_masks [B, Nc], tokens
        int32 [B, Tp], token_mask [B, Tp]), built as at serving time.
      suffix_tokens: int32 [B, T]: request prompt ids ‖ label ids ‖ EOS ‖ pad 0, written after the prefix.
      suffix_mask: bool [B, T]: True on real suffix tokens (prompt, label, EOS).
      loss_mask: bool [B, T]: True on the tokens to predict (label and EOS). Padding rows (see
        `memory_batches(drop_remainder=False)`) are all False.

    Example ("Memory: " → [m1, m2], "Done: nothing." → [d1, d2, d3], T = 8):

        suffix_tokens  m1 m2 d1 d2 d3 EOS 0  0
        suffix_mask    T  T  T  T  T  T   F  F
        loss_mask      F  F  T  T  T  T   F  F

    Teacher forcing: the logits at suffix position j predict token j + 1, so the cross-entropy targets are
    `suffix_tokens[:, 1:]` weighted by `loss_mask[:, 1:]` (the first label token is predicted from the last
    prompt token).
    """

    observation: Observation
    suffix_tokens: jax.Array
    suffix_mask: jax.Array
    loss_mask: jax.Array
    state: jax.Array | None = None  # float32 [B, Ad]: the state token's input of a π0 base (the normalised state,
    #   zero-padded); None for π0.5 (its state is prompt tokens). Read by the served frame of the evaluation only.

    @property
    def batch_size(self) -> int:
        return self.suffix_tokens.shape[0]


def random_batch(config, batch: int, cameras: int, prompt_len: int, suffix_len: int, seed: int = 0) -> MemoryBatch:
    """A MemoryBatch of random inputs for `config` (a pi05 `ModelConfig`): every camera valid, full prompts, a 4-token
    request prompt then the answer; for timing and tracing a step, whose cost does not depend on the values."""
    rng = np.random.default_rng(seed)
    px, vocab = config.siglip.image_size, config.vocab_size
    suffix_mask = np.ones((batch, suffix_len), bool)
    loss_mask = suffix_mask.copy()
    loss_mask[:, : min(4, suffix_len - 1)] = False
    return MemoryBatch(
        observation=Observation(images=rng.uniform(-1, 1, (batch, cameras, px, px, 3)).astype(np.float32),
                                image_masks=np.ones((batch, cameras), bool),
                                tokens=rng.integers(3, vocab, (batch, prompt_len)).astype(np.int32),
                                token_mask=np.ones((batch, prompt_len), bool)),
        suffix_tokens=rng.integers(3, vocab, (batch, suffix_len)).astype(np.int32), suffix_mask=suffix_mask,
        loss_mask=loss_mask)


def encode_memory_suffix(
    tokenizer: Tokenizer, label: str, *, suffix_len: int, prompt: str = MEMORY_PROMPT
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenizes prompt ‖ label ‖ EOS into T = `suffix_len` slots (see `MemoryBatch`).

    Returns:
      (suffix_tokens int32 [T], suffix_mask bool [T], loss_mask bool [T]).
    Raises:
      ValueError when the suffix does not fit (labels are never truncated) or the prompt is empty.
    """
    prompt_ids = encode_suffix_prompt(tokenizer, prompt)
    if not prompt_ids:
        raise ValueError("the suffix prompt is empty; the first label token is predicted from the last prompt token")
    answer = tokenizer.encode(label) + [tokenizer.eos_id]
    n = len(prompt_ids) + len(answer)
    if n > suffix_len:
        raise ValueError(
            f"label {label!r} needs {n} suffix tokens ({len(prompt_ids)} prompt + {len(answer) - 1} label + EOS) "
            f"but suffix_len={suffix_len}; raise suffix_len"
        )
    tokens = np.full((suffix_len,), tokenizer.pad_id, np.int32)
    tokens[:n] = prompt_ids + answer
    suffix_mask = np.arange(suffix_len) < n
    loss_mask = suffix_mask & (np.arange(suffix_len) >= len(prompt_ids))
    return tokens, suffix_mask, loss_mask


def make_memory_batch(
    frames: Sequence[Mapping],
    robot: RobotConfig,
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    *,
    suffix_len: int,
    prompt: str = MEMORY_PROMPT,
    label_key: str = "memory",
    norm_stats: Mapping[str, NormStats] | None = None,
    io: RobotIO | None = None,
) -> MemoryBatch:
    """B frame dicts → a `MemoryBatch` (numpy arrays; the train step places them on device).

    The prefix comes from the base checkpoint's own robot I/O (`io`: `robots.io.observation_rows`, e.g. LeRobot's
    resize and prompt for a LeRobot base, and π0's state token input) or, without it, from
    `transforms.make_observation(robot, model_config, tokenizer, samples, norm_stats)` (openpi's) on LIBERO client samples (`observation/image`, `observation/wrist_image`, `observation/state`,
    `prompt` = the language instruction), so images are resized with padding to the model's Px. The suffix
    is `prompt` ‖ frame[label_key] ‖ EOS: "Memory: " and the memory label by default; another text field
    with its own prompt (e.g. "Scene: " and an extra "scene" key) trains another suffix task the same way.
    """
    if robot.name != "libero":
        raise ValueError(f"memory frames are LIBERO client samples; got robot {robot.name!r}, use robot_config('libero')")
    needed = (*_BATCH_KEYS, label_key)
    for b, f in enumerate(frames):
        missing = [k for k in needed if not isinstance(f, Mapping) or k not in f]
        if missing:
            raise ValueError(f"frame {b} of the batch lacks {missing}; frames need {list(dict.fromkeys(needed))}")
    samples = [
        {"observation/image": f["image"], "observation/wrist_image": f["wrist_image"],
         "observation/state": f["state"], "prompt": f["language_instruction"]}
        for f in frames
    ]
    state = None
    if io is None:
        obs = make_observation(robot, model_config, tokenizer, samples, norm_stats)
    else:  # π0 reads the state as a token: its input rides with the batch for the served evaluation frame
        state_dim = model_config.action_dim if model_config.variant == "pi0" else 0
        obs, state = observation_rows(io, robot, model_config.siglip.image_size, model_config.vocab_size, tokenizer,
                                      samples, state_dim=state_dim)
    rows = [encode_memory_suffix(tokenizer, as_text(f[label_key]), suffix_len=suffix_len, prompt=prompt) for f in frames]
    tokens, suffix_mask, loss_mask = (np.stack(col) for col in zip(*rows))
    check_token_ids(tokens, model_config.vocab_size, "suffix token ids")
    return MemoryBatch(observation=obs, suffix_tokens=tokens, suffix_mask=suffix_mask, loss_mask=loss_mask, state=state)


def epoch_batches(
    num_frames: int, *, batch_size: int, seed: int, epoch: int, shuffle: bool = True, drop_remainder: bool = True
) -> list[np.ndarray]:
    """Frame indices of every batch of one epoch: a permutation drawn from `(seed, epoch)` (or 0..n-1 in
    order), cut into batches; a last partial batch is dropped or kept (shorter) by `drop_remainder`.

    Example: n = 5, batch_size 2, shuffle=False → [[0, 1], [2, 3]] (drop) or [[0, 1], [2, 3], [4]] (keep).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = np.random.default_rng([seed, epoch]).permutation(num_frames) if shuffle else np.arange(num_frames)
    stop = num_frames - num_frames % batch_size if drop_remainder else num_frames
    return [order[i : i + batch_size] for i in range(0, stop, batch_size)]


def memory_batches(
    source: Sequence[Mapping],
    robot: RobotConfig,
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    *,
    batch_size: int,
    suffix_len: int,
    epochs: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    drop_remainder: bool = True,
    prompt: str = MEMORY_PROMPT,
    label_key: str = "memory",
    norm_stats: Mapping[str, NormStats] | None = None,
) -> Iterator[MemoryBatch]:
    """Yields fixed-shape `MemoryBatch`es over `epochs` passes of a random-access frame source.

    Deterministic: the order depends only on (`seed`, epoch). Every batch has exactly `batch_size` rows, so
    a jitted train step compiles once: with `drop_remainder=False` the last partial batch of an epoch is
    filled with copies of its first frame whose `loss_mask` is all False (they add nothing to a masked
    mean loss; `loss_mask.any(-1)` tells the real rows).

    Args:
      source: e.g. `open_memory_dataset(path, split)` or a list of frame dicts.
      prompt, label_key: the suffix task (see `make_memory_batch`).
    Raises:
      ValueError naming the frame indices of a batch whose frames are malformed, or when no batch fits.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    n = len(source)
    if n == 0 or (drop_remainder and n < batch_size):
        raise ValueError(
            f"the source has {n} frames, fewer than batch_size={batch_size} with drop_remainder; "
            "lower batch_size or pass drop_remainder=False"
        )
    for epoch in range(epochs):
        for idx in epoch_batches(n, batch_size=batch_size, seed=seed, epoch=epoch, shuffle=shuffle,
                                 drop_remainder=drop_remainder):
            frames = [source[int(i)] for i in idx]
            frames += [frames[0]] * (batch_size - len(frames))
            try:
                batch = make_memory_batch(frames, robot, model_config, tokenizer, suffix_len=suffix_len,
                                          prompt=prompt, label_key=label_key, norm_stats=norm_stats)
            except (ValueError, KeyError) as e:
                raise ValueError(f"frames {idx.tolist()} (epoch {epoch}): {e}") from e
            if len(idx) < batch_size:
                loss_mask = batch.loss_mask.copy()
                loss_mask[len(idx):] = False
                batch = dataclasses.replace(batch, loss_mask=loss_mask)
            yield batch
