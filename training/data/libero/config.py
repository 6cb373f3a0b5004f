"""What a run makes (`GenConfig`) and how its frames are named and seeded (`frame_key`, `frame_rng`).

A frame is keyed by (task, init index, placed goal-predicate subset, variant); its placement RNG is a
hash of (seed, key, attempt), so any frame can be remade on its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

# Init index of reset layout k is RESET_BASE + k: LIBERO stores 50 initial states per task (indices 0-49),
# and a reset layout is a new draw from the same BDDL init regions (`training.data.libero.scene.TaskScene.layout`).
RESET_BASE = 1000


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenConfig:
    """What to generate and how; `physics_key()` fields must match to resume a run."""

    suite: str = "libero_10"
    tasks: tuple[int, ...] | None = None  # None: every task whose goal has only movable In/On predicates
    inits: tuple[int, ...] = tuple(range(50))  # stored initial-state indices to use
    held_out: tuple[int, ...] = tuple(range(40, 50))  # init indices whose frames get split "heldout"
    variants: int = 3  # placements (jitter draws) per non-empty subset; the empty subset is made once
    resets: int = 0  # extra layouts per task sampled by environment resets (init index RESET_BASE + k)
    reset_variants: int = 1  # `variants` for the reset layouts
    retries: int = 1  # redraws of a rejected placement
    image_size: int = 224
    image_format: str = "jpeg"  # "jpeg" (quality below) or "png"
    jpeg_quality: int = 95
    presettle_steps: int = 10  # control steps (25 physics substeps each) after restoring an init state
    settle_steps: int = 8  # max control steps after placing; stops early once objects are at rest
    min_settle_steps: int = 3
    clearance: float = 0.01  # m between the object's lowest point and the surface below, at release
    jitter: float = 0.01  # m, uniform xy jitter around the target
    spread: float = 0.03  # m, offset of each of several objects that share one target
    max_displacement: float = 0.02  # m, allowed motion of objects that were not placed
    max_tilt_deg: float = 30.0
    shard_size: int = 64
    seed: int = 0

    def __post_init__(self):
        if self.image_format not in ("jpeg", "png"):
            raise ValueError(f"image_format={self.image_format!r}; use 'jpeg' or 'png'")
        if self.variants < 1 or self.reset_variants < 1 or self.retries < 0 or self.shard_size < 1:
            raise ValueError("variants, reset_variants and shard_size must be >= 1 and retries >= 0")
        if self.resets < 0:
            raise ValueError(f"resets must be >= 0, got {self.resets}")
        if any(i >= RESET_BASE for i in self.inits):
            raise ValueError(f"stored init indices must be < {RESET_BASE}; use resets for more layouts")
        if not 1 <= self.min_settle_steps <= self.settle_steps:
            raise ValueError(
                f"need 1 <= min_settle_steps ({self.min_settle_steps}) <= settle_steps ({self.settle_steps})"
            )

    def physics_key(self) -> dict:
        """Settings that change the frames; a resumed run must use the same ones."""
        skip = {"tasks", "inits", "held_out", "variants", "retries", "shard_size", "resets", "reset_variants"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


# ----------------------------------------------------------------------------- frame keys and seeds


def frame_key(task: int, init: int, subset: Sequence[int], variant: int) -> str:
    """"t0-i07-s01-v1": task 0, init 7, goal predicates {0, 1} placed, variant 1 ("s-" for none); reset layout
    k has init RESET_BASE + k ("t0-i1003-...")."""
    return f"t{task}-i{init:02d}-s{''.join(map(str, subset)) or '-'}-v{variant}"


def frame_rng(cfg: GenConfig, key: str, attempt: int) -> np.random.Generator:
    """The placement RNG of one attempt at frame `key`, from (seed, key, attempt) alone."""
    digest = hashlib.sha256(f"{cfg.seed}/{key}/{attempt}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))
