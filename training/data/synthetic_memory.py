"""A synthetic memory task with a known answer, in the frame format of `training.data.frames`.

A top-down table scene with a basket (left half) and a plate (right half), each placed per initial-state
index, and coloured blocks. Each block has a target (basket or plate); a block that is *done* lies inside
its target, otherwise it lies on the front strip of the table. The memory label lists the done blocks in
a fixed order, like the LIBERO labels:

    done = (True, False)  →  "Done: red block in basket."
    done = (True, True)   →  "Done: red block in basket; blue block on plate."
    done = (False, False) →  "Done: nothing."

so the answer is a function of the pixels alone (block colour inside the basket / plate outline), with
2**K labels for K blocks (4 by default). Shapes are sized relative to the image side Px, so at Px = 56 (the
`tiny` SigLIP) a block is ~7 px and the basket ~16 px — visible through 14-px patches. The wrist image and
the state carry no information about the answer.

Initial-state index i fixes the layout (basket and plate positions, table colour); every index is rendered
with all 2**K done-subsets (× `repeats`, with fresh table positions and noise). Held-out frames use
initial-state indices never seen in training, like the LIBERO generator's split:

    splits = synthetic_splits(SyntheticMemoryConfig(image_size=56))   # {"train": 160 frames, "heldout": 40}
    path = write_memory_dataset(out_dir, splits, image_size=56, name="synthetic_memory")

or `python -m training.data.synthetic_memory --out DIR [--image-size 56]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

TARGETS = {"basket": "in", "plate": "on"}  # target → relation word in the label


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticObject:
    name: str  # as written in the label, e.g. "red block"
    color: tuple[int, int, int]  # RGB
    target: str  # "basket" or "plate"


DEFAULT_OBJECTS = (
    SyntheticObject(name="red block", color=(210, 30, 30), target="basket"),
    SyntheticObject(name="blue block", color=(30, 70, 220), target="plate"),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticMemoryConfig:
    image_size: int = 224  # Px, square images
    objects: tuple[SyntheticObject, ...] = DEFAULT_OBJECTS  # K blocks, label order
    num_inits: int = 50  # initial-state indices 0 .. num_inits-1 (scene layouts)
    num_train_inits: int = 40  # indices below this are "train", the rest "heldout"
    repeats: int = 1  # renders per (index, done-subset), with fresh block positions and noise
    noise_std: float = 4.0  # Gaussian pixel noise
    state_dim: int = 8  # Ds of the (uninformative) state vector
    seed: int = 0

    def __post_init__(self):
        if self.image_size < 28:
            raise ValueError(f"SyntheticMemoryConfig.image_size must be >= 28 for blocks to be visible, got {self.image_size}")
        if not self.objects:
            raise ValueError("SyntheticMemoryConfig.objects must name at least one block")
        bad = [o.target for o in self.objects if o.target not in TARGETS]
        if bad:
            raise ValueError(f"SyntheticMemoryConfig.objects: unknown targets {bad}; use {sorted(TARGETS)}")
        names = [o.name for o in self.objects]
        if len(set(names)) != len(names):
            raise ValueError(f"SyntheticMemoryConfig.objects: block names must be distinct, got {names}")
        if not 0 < self.num_train_inits < self.num_inits:
            raise ValueError(
                f"SyntheticMemoryConfig: need 0 < num_train_inits ({self.num_train_inits}) < num_inits ({self.num_inits}) "
                "so that both splits are non-empty"
            )
        if self.repeats < 1:
            raise ValueError(f"SyntheticMemoryConfig.repeats must be >= 1, got {self.repeats}")


def instruction(config: SyntheticMemoryConfig) -> str:
    """The task's language instruction, e.g. "put the red block in the basket and the blue block on the plate"."""
    parts = [f"the {o.name} {TARGETS[o.target]} the {o.target}" for o in config.objects]
    return "put " + " and ".join(parts)


def memory_label(config: SyntheticMemoryConfig, done: Sequence[bool]) -> str:
    """The memory label of a done-pattern (one bool per block, config order)."""
    if len(done) != len(config.objects):
        raise ValueError(f"done has {len(done)} entries but the config has {len(config.objects)} blocks")
    parts = [f"{o.name} {TARGETS[o.target]} {o.target}" for o, d in zip(config.objects, done) if d]
    return "Done: " + ("; ".join(parts) if parts else "nothing") + "."


def scene_description(config: SyntheticMemoryConfig, done: Sequence[bool]) -> str:
    """Where every block is, done or not: "Scene: red block in basket; blue block on table."

    A second suffix task over the same frames (prompt "Scene: "), e.g. to pre-train a tiny base model's
    vision and language before a memory adapter is trained on top of it.
    """
    if len(done) != len(config.objects):
        raise ValueError(f"done has {len(done)} entries but the config has {len(config.objects)} blocks")
    parts = [f"{o.name} {TARGETS[o.target]} {o.target}" if d else f"{o.name} on table"
             for o, d in zip(config.objects, done)]
    return "Scene: " + "; ".join(parts) + "."


def all_labels(config: SyntheticMemoryConfig) -> list[str]:
    """Every label of the task (2**K), in done-mask order (bit k = block k done)."""
    return [memory_label(config, _done_bits(m, len(config.objects))) for m in range(2 ** len(config.objects))]


def _done_bits(mask: int, k: int) -> tuple[bool, ...]:
    return tuple(bool(mask >> j & 1) for j in range(k))


# -------------------------------------------------------------------------------------------------
# Rendering (coordinates are fractions of the image side; y grows downwards)
# -------------------------------------------------------------------------------------------------

_BLOCK = 0.065  # block half-size
_BASKET = 0.15  # basket half-size (outer)
_PLATE = 0.14  # plate radius


def _layout(config: SyntheticMemoryConfig, init_index: int) -> dict:
    rng = np.random.default_rng([config.seed, init_index])
    return {
        "table": np.array([150, 120, 90]) + rng.integers(-20, 21, 3),
        "basket": np.array([0.27, 0.45]) + rng.uniform(-0.05, 0.05, 2),
        "plate": np.array([0.73, 0.45]) + rng.uniform(-0.05, 0.05, 2),
        "arm_x": rng.uniform(0.2, 0.8),
    }


def _block_positions(config, layout, done, rng) -> list[np.ndarray]:
    """Centres of the blocks: inside the target when done (spread when sharing one), else on the front strip."""
    pos, on_table = [], []
    sharing = {t: [k for k, o in enumerate(config.objects) if o.target == t and done[k]] for t in TARGETS}
    for k, (obj, d) in enumerate(zip(config.objects, done)):
        if d:
            mates = sharing[obj.target]
            spread = (mates.index(k) - (len(mates) - 1) / 2) * 2.2 * _BLOCK
            jitter = rng.uniform(-0.02, 0.02, 2)
            pos.append(layout[obj.target] + np.array([spread, 0.0]) + jitter)
        else:
            pos.append(None)
            on_table.append(k)
    # Front strip: evenly spaced slots in random order, so table blocks never overlap.
    slots = np.linspace(0.12, 0.88, max(len(config.objects), 2))
    for k, slot in zip(on_table, rng.permutation(slots)):
        pos[k] = np.array([slot + rng.uniform(-0.03, 0.03), rng.uniform(0.80, 0.88)])
    return pos


def _grid(s: int):
    c = (np.arange(s) + 0.5) / s
    return np.meshgrid(c, c)  # x, y


def _render_scene(config, layout, done, rng) -> np.ndarray:
    s = config.image_size
    x, y = _grid(s)
    img = np.empty((s, s, 3), np.float64)
    img[:] = layout["table"] * (0.9 + 0.2 * x)[..., None]  # lit from the right
    img[y < 0.16] = (70, 70, 80)  # back wall
    # A robot arm reaching in from the back (a distractor, constant per layout).
    img[(np.abs(x - layout["arm_x"]) < 0.04) & (y < 0.3)] = (180, 180, 185)
    bx, by = layout["basket"]
    in_basket = (np.abs(x - bx) < _BASKET) & (np.abs(y - by) < _BASKET)
    img[in_basket] = (110, 70, 30)  # wicker rim
    img[(np.abs(x - bx) < _BASKET - 0.03) & (np.abs(y - by) < _BASKET - 0.03)] = (200, 160, 100)
    px, py = layout["plate"]
    r = np.hypot(x - px, y - py)
    img[r < _PLATE] = (150, 150, 150)  # rim
    img[r < _PLATE - 0.02] = (240, 240, 235)
    for obj, (cx, cy) in zip(config.objects, _block_positions(config, layout, done, rng)):
        img[(np.abs(x - cx) < _BLOCK) & (np.abs(y - cy) < _BLOCK)] = obj.color
    img += rng.normal(0.0, config.noise_std, img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def _render_wrist(config, rng) -> np.ndarray:
    s = config.image_size
    x, y = _grid(s)
    img = np.full((s, s, 3), 35.0)
    img[(y > 0.7) & (np.abs(x - 0.3) < 0.06)] = (120, 120, 125)  # gripper fingers
    img[(y > 0.7) & (np.abs(x - 0.7) < 0.06)] = (120, 120, 125)
    img += rng.normal(0.0, config.noise_std, img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def render_frame(config: SyntheticMemoryConfig, init_index: int, done: Sequence[bool], repeat: int = 0) -> dict:
    """One frame dict (the `training.data.frames` format) for a layout index and a done-pattern.

    Returns:
      {"image", "wrist_image": uint8 [Px, Px, 3], "state": float32 [Ds], "language_instruction", "memory",
       "task": str, "init_index": int, "done_mask": int (bit k = block k done), "scene": str (see
       `scene_description`)}. Deterministic in
      (config.seed, init_index, done, repeat).
    """
    done = tuple(bool(d) for d in done)
    mask = sum(1 << k for k, d in enumerate(done) if d)
    rng = np.random.default_rng([config.seed, init_index, mask, repeat, 1])
    layout = _layout(config, init_index)
    text = instruction(config)
    return {
        "image": _render_scene(config, layout, done, rng),
        "wrist_image": _render_wrist(config, rng),
        "state": rng.uniform(-1.0, 1.0, config.state_dim).astype(np.float32),
        "language_instruction": text,
        "memory": memory_label(config, done),
        "task": text,
        "init_index": int(init_index),
        "done_mask": mask,
        "scene": scene_description(config, done),
    }


def synthetic_frames(config: SyntheticMemoryConfig, init_indices: Iterable[int]) -> Iterator[dict]:
    """Every done-subset (× repeats) of every given layout index, in (index, mask, repeat) order."""
    k = len(config.objects)
    for i, mask, rep in itertools.product(init_indices, range(2 ** k), range(config.repeats)):
        yield render_frame(config, i, _done_bits(mask, k), rep)


def synthetic_splits(config: SyntheticMemoryConfig) -> dict[str, list[dict]]:
    """{"train": frames of indices < num_train_inits, "heldout": frames of the remaining indices}."""
    return {
        "train": list(synthetic_frames(config, range(config.num_train_inits))),
        "heldout": list(synthetic_frames(config, range(config.num_train_inits, config.num_inits))),
    }


def write_synthetic_memory_dataset(
    out_dir, config: SyntheticMemoryConfig = SyntheticMemoryConfig(), *, name: str = "synthetic_memory",
    overwrite: bool = False,
) -> Path:
    """Renders both splits and writes them with `training.data.frames.write_memory_dataset` (streamed)."""
    from training.data.frames import write_memory_dataset

    splits = {
        "train": synthetic_frames(config, range(config.num_train_inits)),
        "heldout": synthetic_frames(config, range(config.num_train_inits, config.num_inits)),
    }
    return write_memory_dataset(out_dir, splits, image_size=config.image_size, state_dim=config.state_dim,
                                name=name, overwrite=overwrite)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic memory task as a tfds array_record dataset.")
    parser.add_argument("--out", required=True, help="tfds data_dir (the dataset goes to OUT/NAME/1.0.0)")
    parser.add_argument("--name", default="synthetic_memory")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--inits", type=int, default=50, help="layout indices in all")
    parser.add_argument("--train-inits", type=int, default=40, help="layout indices used for training")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    config = SyntheticMemoryConfig(image_size=args.image_size, num_inits=args.inits, num_train_inits=args.train_inits,
                                   repeats=args.repeats, seed=args.seed)
    path = write_synthetic_memory_dataset(args.out, config, name=args.name, overwrite=args.overwrite)
    print(f"wrote {path} with labels {all_labels(config)}")


if __name__ == "__main__":
    main()
