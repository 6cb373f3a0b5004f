"""LeRobot's robot I/O for the π0.5 and π0 checkpoints it writes, as pure numpy (never jitted).

Axes (`oxygen_jax.axes`): B batch, Nc cameras, Px the square image side (`image_resolution`), Tp prompt
tokens (`tokenizer_max_length`), Ha chunk, Ad padded model state / action dim (`max_state_dim`,
`max_action_dim`), Ds / Da the robot's state / action dims.

    batch {camera key: float [B, 3, h, w] in [0, 1] (or uint8 [B, h, w, 3]), "observation.state": [B, Ds],
           "task": [B] str}  ──make_observation──▶  Observation (images [B, Nc, Px, Px, 3] in [-1, 1]), and for
                                                   π0 the normalised state zero-padded to float32 [B, Ad]
    model actions [B, Ha, Ad] (normalised)  ──robot_actions──▶  float32 [B, Ha, Da] in the robot's units

`LeRobotIO` holds what a checkpoint's files say (`ckpts.lerobot.load` reads them). Where LeRobot differs
from openpi (`robots.transforms`), this module follows LeRobot:

* images: resized with pad to `image_resolution` only when not already that size; bilinear with
  align_corners=False and no antialiasing (torch's `F.interpolate`, where openpi's JAX path uses PIL's
  antialiased filter on uint8), clamped to [0, 1], zero padding split evenly (the odd row / column at the
  bottom / right), then x * 2 - 1, so padding is -1. A uint8 HWC image (a robot client's) is x / 255 first.
  Example: a 48 x 64 image into 56 x 56: ratio max(64/56, 48/56) = 8/7, resized to 42 x 56, 7 zero rows above
  and below.
* normalisation (`normalize`, `unnormalize`): QUANTILES 2 (x - q01) / (q99 - q01) - 1 with eps only where
  q99 == q01 (openpi adds 1e-6 everywhere), un-normalised (y + 1) (q99 - q01) / 2 + q01; MEAN_STD
  (x - mean) / (std + eps), un-normalised y * std + mean (no eps: not the exact inverse); MIN_MAX and
  QUANTILE10 like QUANTILES on (min, max) and (q10, q90). float32 arithmetic, as LeRobot's tensors.
* prompts: π0.5 "Task: {task cleaned}, State: {bins};\\nAction: " over the normalised, unpadded state, as
  openpi's (`tokenizer.format_action_prompt`); π0 the task + "\\n" if it does not end with one, not cleaned
  (underscores stay), encoded as one string (openpi cleans it and encodes "\\n" apart). BOS first,
  right-padded with 0 to `tokenizer_max_length`, truncated beyond it (with a warning).
* cameras: in `input_features` order, then `empty_cameras` slots; a camera the batch lacks goes after the
  present ones as an image of -1 with mask False for every row (`camera_order`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from oxygen_jax.models.observation import Observation
from oxygen_jax.robots.io import Preprocess
from oxygen_jax.robots.normalize import check_statistics
from oxygen_jax.robots.tokenizer import Tokenizer, format_action_prompt

NormMode = Literal["IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"]
STATS_OF: dict[str, tuple[str, ...]] = {
    "IDENTITY": (), "MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
    "QUANTILE10": ("q10", "q90"),
}
"""The two statistics each LeRobot normalisation mode reads (lower / upper bound for the range modes)."""

STATE_KEY, ACTION_KEY, TASK_KEY = "observation.state", "action", "task"
EMPTY_CAMERA = "observation.images.empty_camera_{}"  # LeRobot's name for the i-th `empty_cameras` slot


# -------------------------------------------------------------------------------------------------
# Normalisation
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureNorm:
    """How LeRobot's (un)normaliser treats one feature.

    Attributes:
      mode: "IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES" or "QUANTILE10".
      stats: the mode's two statistics (`STATS_OF[mode]`), float32 [D] each; empty for IDENTITY.
      eps: the processor's eps (LeRobot: 1e-8): added to std, or standing in for a zero range.
    """

    mode: str
    stats: Mapping[str, np.ndarray]
    eps: float

    def __post_init__(self):
        if self.mode not in STATS_OF:
            raise ValueError(f"normalisation mode {self.mode!r} is not LeRobot's; expected one of {sorted(STATS_OF)}")
        if set(self.stats) != set(STATS_OF[self.mode]):
            raise ValueError(f"{self.mode} normalisation needs statistics {STATS_OF[self.mode]}, got {sorted(self.stats)}")
        shapes = {np.shape(v) for v in self.stats.values()}
        if len(shapes) > 1 or any(len(s) != 1 for s in shapes):
            raise ValueError(f"{self.mode} statistics must be vectors [D] of one length, got shapes {sorted(shapes)}")
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"normaliser eps must be a finite number >= 0, got {self.eps!r}")

    @property
    def dim(self) -> int | None:
        """D, or None for IDENTITY (any width)."""
        return None if not self.stats else int(np.shape(next(iter(self.stats.values())))[0])

    def _bounds(self) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = (np.asarray(self.stats[k], np.float32) for k in STATS_OF[self.mode])
        span = hi - lo
        return lo, np.where(span == 0, np.float32(self.eps), span)  # eps only where the range is empty


def check_feature_stats(where: str, mode: str, stats: Mapping[str, np.ndarray]) -> None:
    """One-line ValueError unless the statistics are finite, within bounds, std >= 0 and lower <= upper bound."""
    check_statistics(where, **{k: stats[k] for k in STATS_OF[mode]})  # finite, bounded, std >= 0
    if mode in ("MIN_MAX", "QUANTILES", "QUANTILE10"):
        lo, hi = (np.asarray(stats[k], np.float64) for k in STATS_OF[mode])
        if np.any(lo > hi):
            i = int(np.argmax(lo > hi))
            names = STATS_OF[mode]
            raise ValueError(f"{where}: {names[0]}[{i}] = {lo[i]!r} is above {names[1]}[{i}] = {hi[i]!r}; the "
                             "statistics are damaged")


def _check_width(x: np.ndarray, norm: FeatureNorm, what: str) -> None:
    if norm.dim is not None and (x.ndim == 0 or x.shape[-1] != norm.dim):
        raise ValueError(f"{what}: last dim {x.shape[-1] if x.ndim else 'none'} does not match the checkpoint's "
                         f"{norm.dim}-dim statistics")


def normalize(x, norm: FeatureNorm, what: str = "feature") -> np.ndarray:
    """LeRobot's forward normalisation of x [..., D] (module docstring), float32 [..., D]."""
    x = np.asarray(x, np.float32)
    _check_width(x, norm, what)
    if norm.mode == "IDENTITY":
        return x
    if norm.mode == "MEAN_STD":
        mean, std = (np.asarray(norm.stats[k], np.float32) for k in ("mean", "std"))
        return (x - mean) / (std + np.float32(norm.eps))
    lo, span = norm._bounds()
    return np.float32(2.0) * (x - lo) / span - np.float32(1.0)


def unnormalize(y, norm: FeatureNorm, what: str = "feature") -> np.ndarray:
    """LeRobot's un-normalisation of y [..., D] (module docstring), float32 [..., D]."""
    y = np.asarray(y, np.float32)
    _check_width(y, norm, what)
    if norm.mode == "IDENTITY":
        return y
    if norm.mode == "MEAN_STD":
        mean, std = (np.asarray(norm.stats[k], np.float32) for k in ("mean", "std"))
        return y * std + mean
    lo, span = norm._bounds()
    return (y + np.float32(1.0)) * span / np.float32(2.0) + lo


# -------------------------------------------------------------------------------------------------
# Images
# -------------------------------------------------------------------------------------------------


def _source_index(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """torch's bilinear taps along one axis (align_corners=False): (i0, i1, weight of i1), float32 maths.

    Source coordinate (o + 0.5) * n_in / n_out - 0.5, clamped at 0; i1 = min(i0 + 1, n_in - 1).
    Example: 4 -> 2 samples at 0.5 and 2.5: taps (0, 1) and (2, 3), weight 0.5 each.
    """
    scale = np.float32(n_in / n_out)
    src = np.maximum(scale * (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5), np.float32(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    return i0, np.minimum(i0 + 1, n_in - 1), (src - i0).astype(np.float32)


def _bilinear(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """[..., h, w] -> [..., height, width], separable bilinear without antialiasing."""
    i0, i1, w = _source_index(images.shape[-2], height)
    rows = images[..., i0, :] * (1 - w)[:, None] + images[..., i1, :] * w[:, None]
    j0, j1, v = _source_index(images.shape[-1], width)
    return rows[..., j0] * (1 - v) + rows[..., j1] * v


def resize_with_pad(images, height: int, width: int) -> np.ndarray:
    """LeRobot's resize with pad: float [..., 3, h, w] in [0, 1] -> float32 [..., 3, height, width] in [0, 1].

    Resized to (int(h / ratio), int(w / ratio)), ratio = max(w / width, h / height), clamped to [0, 1] and
    zero-padded evenly (the odd row / column at the bottom / right). Example in the module docstring.
    """
    images = np.asarray(images, np.float32)
    if images.ndim < 3 or images.shape[-3] != 3:
        raise ValueError(f"resize_with_pad expects float images [..., 3, h, w], got shape {images.shape}")
    h, w = images.shape[-2:]
    if min(h, w, height, width) <= 0:
        raise ValueError(f"cannot resize a {h} x {w} image to {height} x {width}")
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    resized = np.clip(_bilinear(images, rh, rw), 0.0, 1.0)
    top, left = (height - rh) // 2, (width - rw) // 2
    out = np.zeros(images.shape[:-2] + (height, width), np.float32)
    out[..., top:top + rh, left:left + rw] = resized
    return out


def preprocess_image(image, resolution: tuple[int, int], what: str = "image") -> np.ndarray:
    """One camera's batch as LeRobot's policy feeds SigLIP: float32 [B, 3, Px, Px] in [-1, 1].

    Args:
      image: float [B, 3, h, w] in [0, 1] (a LeRobot dataset's layout) or uint8 [B, h, w, 3] (a robot client's;
        divided by 255 first). Resized with pad only when (h, w) differs from `resolution`.
      resolution: (height, width), the checkpoint's `image_resolution`.
      what: the camera key, for messages.
    """
    a = np.asarray(image)
    if a.dtype == np.uint8:
        if a.ndim != 4 or a.shape[-1] != 3:
            raise ValueError(f"{what}: a uint8 image must be [batch, h, w, 3] (HWC), got shape {a.shape}")
        a = a.transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255.0)
    elif np.issubdtype(a.dtype, np.floating):
        if a.ndim != 4 or a.shape[1] != 3:
            raise ValueError(f"{what}: a float image must be [batch, 3, h, w] (CHW) in [0, 1], got shape {a.shape}")
        if not np.isfinite(a).all() or a.min(initial=0.0) < 0 or a.max(initial=0.0) > 1:
            raise ValueError(f"{what}: float images must be finite and in [0, 1] (LeRobot's layout); send uint8 HWC "
                             "pixels instead")
        a = a.astype(np.float32)
    else:
        raise ValueError(f"{what}: expected float [batch, 3, h, w] in [0, 1] or uint8 [batch, h, w, 3], got dtype {a.dtype}")
    if 0 in a.shape:
        raise ValueError(f"{what}: empty image of shape {a.shape}")
    if tuple(a.shape[-2:]) != tuple(resolution):
        a = resize_with_pad(a, *resolution)
    return a * np.float32(2.0) - np.float32(1.0)


def camera_images(batch: Mapping[str, Any], cameras: Sequence[str], resolution: tuple[int, int]
                  ) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Every camera of the checkpoint, present ones first (LeRobot's `_preprocess_images`).

    Returns:
      (images float32 [B, Nc, 3, Px, Px] in [-1, 1], masks bool [B, Nc], camera order): cameras in `batch`
      in `cameras` order, then the missing ones as -1 images with mask False for every row.
    Example: cameras (base, left, right) with left missing -> order (base, right, left), masks [T, T, F].
    """
    present = [c for c in cameras if c in batch]
    if not present:
        raise ValueError(f"the batch holds none of the checkpoint's cameras {list(cameras)}; at least one is needed")
    images = [preprocess_image(batch[c], resolution, c) for c in present]
    rows = {im.shape[0] for im in images}
    if len(rows) != 1:
        raise ValueError(f"cameras {present} have different batch sizes {sorted(rows)}")
    missing = [c for c in cameras if c not in batch]
    b = rows.pop()
    images += [np.full_like(images[0], -1.0) for _ in missing]
    masks = np.array([[True] * len(present) + [False] * len(missing)] * b, bool)
    return np.stack(images, 1), masks, tuple(present + missing)


# -------------------------------------------------------------------------------------------------
# Prompts
# -------------------------------------------------------------------------------------------------


def pi0_prompt(task: str) -> str:
    """LeRobot's π0 prompt: the task as given, with "\\n" appended unless it ends with one."""
    return task if task.endswith("\n") else task + "\n"


def pi05_prompt(task: str, state) -> str:
    """LeRobot's π0.5 prompt (openpi's): "Task: {cleaned}, State: {bins};\\nAction: " from the normalised,
    unpadded state [Ds] (`tokenizer.discretize_state`: bins over linspace(-1, 1, 257)[:-1], minus 1)."""
    return format_action_prompt(task, np.asarray(state))


def tokenize_prompts(tokenizer: Tokenizer, prompts: Sequence[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """BOS + pieces of each prompt, right-padded with 0 (truncated beyond `max_length`, with a warning).

    Returns:
      (tokens int32 [B, Tp], mask bool [B, Tp]).
    """
    tokens = np.zeros((len(prompts), max_length), np.int32)
    mask = np.zeros((len(prompts), max_length), bool)
    for b, text in enumerate(prompts):
        ids = tokenizer.encode(text, add_bos=True)
        if len(ids) > max_length:
            warnings.warn(f"prompt {b} has {len(ids)} tokens, more than tokenizer_max_length={max_length}: truncated "
                          "(as LeRobot does)", stacklevel=2)
            ids = ids[:max_length]
        tokens[b, :len(ids)], mask[b, :len(ids)] = ids, True
    return tokens, mask


# -------------------------------------------------------------------------------------------------
# A checkpoint's I/O
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class LeRobotIO:
    """What a LeRobot π checkpoint's config.json and processor files say about its robot I/O.

    Attributes:
      variant: "pi05" or "pi0" (config.json `type`).
      cameras: the VISUAL `input_features` keys in order, then `empty_cameras` slots (`EMPTY_CAMERA`).
      empty_cameras: how many of `cameras` are LeRobot's always-empty slots.
      image_resolution: (height, width) SigLIP reads.
      state_dim, action_dim: Ds, Da (`input_features["observation.state"]`, `output_features["action"]`).
      max_state_dim, max_action_dim: Ad the model pads state and actions to.
      chunk_size: Ha the model predicts; n_action_steps: how many of them LeRobot executes per chunk.
      tokenizer_max_length: Tp; tokenizer_name: the Hugging Face tokenizer the preprocessor names.
      normalize: {feature key: FeatureNorm} of the preprocessor's normaliser (state, action, cameras).
      unnormalize: {feature key: FeatureNorm} of the postprocessor's un-normaliser (the action).
      rename_map: the preprocessor's {batch key: feature key} renames (usually empty).
    """

    variant: str
    cameras: tuple[str, ...]
    empty_cameras: int
    image_resolution: tuple[int, int]
    state_dim: int
    action_dim: int
    max_state_dim: int
    max_action_dim: int
    chunk_size: int
    n_action_steps: int
    tokenizer_max_length: int
    tokenizer_name: str
    normalize: Mapping[str, FeatureNorm]
    unnormalize: Mapping[str, FeatureNorm]
    rename_map: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def prompt(self, task: str, normalized_state) -> str:
        """The text the tokenizer gets: `pi05_prompt` (state in it) or `pi0_prompt` (state ignored)."""
        return pi05_prompt(task, normalized_state) if self.variant == "pi05" else pi0_prompt(task)


def _tasks(batch: Mapping[str, Any], rows: int) -> list[str]:
    task = batch.get(TASK_KEY)
    tasks = [task] * rows if isinstance(task, (str, bytes)) else task
    if tasks is None or len(tasks) != rows:
        raise ValueError(f"batch[{TASK_KEY!r}] must be one task string or {rows} of them, got {task!r:.80}")
    out = [t.decode("utf-8") if isinstance(t, bytes) else t for t in tasks]
    if not all(isinstance(t, str) for t in out):
        raise ValueError(f"batch[{TASK_KEY!r}] must hold strings, got {[type(t).__name__ for t in out]}")
    return [str(t) for t in out]


def normalized_state(io: LeRobotIO, batch: Mapping[str, Any]) -> np.ndarray:
    """batch["observation.state"] [B, Ds] (or [Ds]) through the checkpoint's normaliser: float32 [B, Ds]."""
    if STATE_KEY not in batch:
        raise ValueError(f"the batch has no {STATE_KEY!r} ({io.state_dim} numbers per row)")
    state = np.asarray(batch[STATE_KEY], np.float64)
    state = state[None] if state.ndim == 1 else state
    if state.ndim != 2 or state.shape[1] != io.state_dim:
        raise ValueError(f"{STATE_KEY}: expected [batch, {io.state_dim}], got shape {state.shape}")
    if not np.isfinite(state).all():
        raise ValueError(f"{STATE_KEY}: holds NaN or inf")
    norm = io.normalize.get(STATE_KEY)
    with np.errstate(over="ignore", invalid="ignore"):
        out = state.astype(np.float32) if norm is None else normalize(state, norm, STATE_KEY)
    if not np.isfinite(out).all():
        raise ValueError(f"{STATE_KEY}: normalising it with the checkpoint's statistics leaves float32; send the "
                         "robot's raw state in its own units")
    return out


def make_observation(io: LeRobotIO, tokenizer: Tokenizer, batch: Mapping[str, Any]) -> tuple[Observation, np.ndarray | None]:
    """A LeRobot batch as the model reads it (numpy arrays; the caller places them on device).

    Args:
      io: the checkpoint's I/O facts.
      tokenizer: the PaliGemma tokenizer the checkpoint was trained with.
      batch: {camera key: image, "observation.state": [B, Ds], "task": str or [B] str} (keys renamed by
        `io.rename_map` first); cameras absent from it are masked (module docstring).
    Returns:
      (Observation(images float32 [B, Nc, Px, Px, 3], image_masks [B, Nc], tokens [B, Tp], token_mask), the
      normalised state zero-padded to float32 [B, max_state_dim] for π0, None for π0.5 (its state is in the
      prompt)).
    """
    if not isinstance(batch, Mapping):
        raise ValueError(f"a LeRobot batch must be a dict of features, got {type(batch).__name__}")
    batch = {io.rename_map.get(k, k): v for k, v in batch.items()}
    images, masks, _ = camera_images(batch, io.cameras, io.image_resolution)
    state = normalized_state(io, batch)
    if state.shape[0] != images.shape[0]:
        raise ValueError(f"{STATE_KEY} has {state.shape[0]} rows but the cameras {images.shape[0]}")
    prompts = [io.prompt(t, s) for t, s in zip(_tasks(batch, state.shape[0]), state)]
    tokens, token_mask = tokenize_prompts(tokenizer, prompts, io.tokenizer_max_length)
    obs = Observation(images=images.transpose(0, 1, 3, 4, 2), image_masks=masks, tokens=tokens, token_mask=token_mask)
    if io.variant == "pi05":
        return obs, None
    padded = np.zeros((state.shape[0], io.max_state_dim), np.float32)
    padded[:, :io.state_dim] = state
    return obs, padded


def robot_actions(io: LeRobotIO, actions) -> np.ndarray:
    """The model's normalised chunk [B, Ha, Ad] (or [Ha, Ad]) cut to Da and un-normalised: float32 [..., Ha, Da]."""
    a = np.asarray(actions, np.float32)
    if a.ndim not in (2, 3) or a.shape[-1] < io.action_dim:
        raise ValueError(f"actions must be [batch, horizon, >= {io.action_dim}] or [horizon, ...], got shape {a.shape}")
    a = a[..., :io.action_dim]
    norm = io.unnormalize.get(ACTION_KEY)
    return a if norm is None else unnormalize(a, norm, ACTION_KEY)


@dataclasses.dataclass(frozen=True, eq=False)
class LeRobotPreprocess(Preprocess):
    """A LeRobot checkpoint's conventions behind `robots.io.Preprocess` (what `robots.io.observation_rows` and
    `robot_chunk` apply to robot-client samples): its normaliser, its resize on uint8 HWC pixels, its prompt."""

    io: LeRobotIO

    def normalize_state(self, state: np.ndarray) -> np.ndarray:
        """[Ds] -> float32 [Ds] through the checkpoint's state normaliser."""
        return normalized_state(self.io, {STATE_KEY: np.asarray(state)[None]})[0]

    def unnormalize_actions(self, actions: np.ndarray) -> np.ndarray:
        """[..., Ha, Ad] -> float32 [..., Ha, Ad]: the first Da dims un-normalised, the padded ones unchanged."""
        a = np.array(actions, np.float32)
        d = self.io.action_dim
        if a.ndim < 1 or a.shape[-1] < d:
            raise ValueError(f"actions must end in >= {d} dims, got shape {a.shape}")
        norm = self.io.unnormalize.get(ACTION_KEY)
        if norm is not None:
            a[..., :d] = unnormalize(a[..., :d], norm, ACTION_KEY)
        return a

    def pixels(self, image: np.ndarray, size: int) -> np.ndarray:
        """One uint8 [Hi, Wi, 3] image -> float32 [size, size, 3] in [-1, 1] (`preprocess_image`)."""
        return preprocess_image(np.asarray(image)[None], (size, size))[0].transpose(1, 2, 0)

    def prompt(self, tokenizer: Tokenizer, task: str, state: np.ndarray, max_len: int, robot=None
               ) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [Tp], mask bool [Tp]) of `io.prompt(task, state)`; `robot` is not read (the checkpoint decides)."""
        tokens, mask = tokenize_prompts(tokenizer, [self.io.prompt(task, state)], max_len)
        return tokens[0], mask[0]
