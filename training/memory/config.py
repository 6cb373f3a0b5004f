"""What one textual-memory training run optimises and how: the model presets a run starts from
(`preset_config`, the embedded demo's shape) and `TrainConfig` (mode, task, adapter, schedule, seed).

Axes (`oxygen_jax.axes`): B batch rows, T suffix tokens, Tp prompt tokens in the prefix, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Literal

import optax

from oxygen_jax.models import lora
from oxygen_jax.models.pi05.config import ExpertConfig, ModelConfig, model_config
from oxygen_jax.models.vision.siglip import SiglipConfig
from training.memory.data import MEMORY_PROMPT
from training.flow.train_step import OptimizerConfig, make_optimizer

Mode = Literal["adapter", "base"]
DEMO_PROMPT_LEN = 48  # default Tp: LIBERO instructions (<= 44 tokens with the built-in demo tokenizer) + BOS + "\n"


def demo_model_config(vocab_size: int, *, image_size: int = 224, patch_size: int = 16) -> ModelConfig:
    """The embedded demo's π0.5 shape: 4-layer experts (VLM 128 wide, action 64), a 3-layer SigLIP 128 wide
    reading 224 px images in 16 px patches (14 × 14 per camera).

    2.16 M parameters (8.6 MB in float32) at vocabulary 512: small enough to ship in the repository and to
    train on two CPU cores (~1-2 s per batch of 16 under load), with full-resolution LIBERO frames (objects in
    the basket are a few pixels; at 112 px held-out accuracy was lower in the same number of steps).
    """
    return ModelConfig(
        vlm=ExpertConfig(width=128, depth=4, mlp_dim=512, num_heads=4, num_kv_heads=1, head_dim=32),
        action_expert=ExpertConfig(width=64, depth=4, mlp_dim=256, num_heads=4, num_kv_heads=1, head_dim=32),
        siglip=SiglipConfig(width=128, depth=3, mlp_dim=512, num_heads=4, patch_size=patch_size, image_size=image_size),
        vocab_size=vocab_size,
    )


def preset_config(name: str, vocab_size: int, image_size: int | None = None, patch_size: int | None = None
                  ) -> ModelConfig:
    """'tiny' (the test preset; vocabulary 1024) or 'demo' (`demo_model_config`), optionally at another image
    size / patch size."""
    if name == "demo":
        kw = {k: v for k, v in (("image_size", image_size), ("patch_size", patch_size)) if v is not None}
        return demo_model_config(vocab_size, **kw)
    if name != "tiny":
        raise ValueError(f"unknown preset {name!r}; use 'tiny' or 'demo' (or start from a checkpoint with --base)")
    cfg = model_config("tiny")
    if vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} ids but the tiny preset's vocabulary is {cfg.vocab_size}")
    if image_size is not None or patch_size is not None:
        cfg = cfg.replace(siglip=dataclasses.replace(cfg.siglip, image_size=image_size or cfg.siglip.image_size,
                                                     patch_size=patch_size or cfg.siglip.patch_size))
    return cfg


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What one training run optimises and how (`steps` and the schedule define the run; see `optimizer`).

    Attributes:
      mode: "adapter" (LoRA bank only) or "base" (VLM expert + SigLIP + embedding).
      prompt, label_key: the suffix task, e.g. ("Memory: ", "memory") or ("Scene: ", "scene").
      steps: optimisation steps in all (a resumed run continues to the same total).
      batch_size: B rows per step (a multiple of the mesh's data axis).
      suffix_len: T; must hold prompt + the longest label + EOS.
      rank, alpha, targets: the adapter (alpha default = rank, i.e. scaling 1); ignored in base mode.
      peak_lr, final_lr, warmup_steps, weight_decay, clip_norm: AdamW, warm-up + cosine to final_lr at `steps`.
      seed: batch order, adapter init and augmentation draws.
      augment: training-image augmentation strength, 0 = none: each camera image is shifted by up to
        `augment` of its side (edge-padded crop) and its brightness scaled by 1 ± augment, drawn per
        (seed, step, row), so a resumed run sees the same pixels.
    """

    mode: Mode = "adapter"
    prompt: str = MEMORY_PROMPT
    label_key: str = "memory"
    steps: int = 300
    batch_size: int = 16
    suffix_len: int = 32
    rank: int = 8
    alpha: float | None = None
    targets: tuple[str, ...] = lora.TARGETS
    peak_lr: float = 3e-3
    final_lr: float = 1e-4
    warmup_steps: int = 20
    weight_decay: float = 1e-4
    clip_norm: float = 1.0
    seed: int = 0
    augment: float = 0.0

    def __post_init__(self):
        if self.mode not in ("adapter", "base"):
            raise ValueError(f"TrainConfig.mode must be 'adapter' or 'base', got {self.mode!r}")
        for f in ("steps", "batch_size", "suffix_len", "rank"):
            if getattr(self, f) < 1:
                raise ValueError(f"TrainConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.warmup_steps < 0 or not self.peak_lr > 0 or not self.final_lr >= 0:
            raise ValueError("TrainConfig: need warmup_steps >= 0, peak_lr > 0 and final_lr >= 0")
        for f in ("peak_lr", "final_lr", "weight_decay", "clip_norm", "augment"):
            if not math.isfinite(getattr(self, f)):
                raise ValueError(f"TrainConfig.{f} must be finite, got {getattr(self, f)}")
        if not self.weight_decay >= 0 or not self.clip_norm > 0:
            raise ValueError(f"TrainConfig: need weight_decay >= 0 and clip_norm > 0, got {self.weight_decay}, "
                             f"{self.clip_norm}")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"TrainConfig.alpha must be a finite number > 0 (or None: rank), got {self.alpha}")
        if not 0.0 <= self.augment < 0.5:
            raise ValueError(f"TrainConfig.augment must be in [0, 0.5), got {self.augment}")
        bad = [t for t in self.targets if t not in lora.TARGETS]
        if bad or not self.targets:
            raise ValueError(f"TrainConfig.targets must be a non-empty subset of {lora.TARGETS}, got {self.targets}")

    def optimizer(self) -> optax.GradientTransformation:
        """AdamW (b1 0.9, b2 0.95) after clipping at `clip_norm`; warm-up then cosine decay to `final_lr` at `steps`."""
        return make_optimizer(OptimizerConfig(
            peak_lr=self.peak_lr, final_lr=self.final_lr, warmup_steps=self.warmup_steps,
            decay_steps=max(self.steps, self.warmup_steps + 1), weight_decay=self.weight_decay, clip_norm=self.clip_norm,
        ))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "TrainConfig":
        d = dict(d)
        d["targets"] = tuple(d["targets"])
        return cls(**d)


def checkpoint_config_json(config: ModelConfig) -> dict:
    """The model config as JSON (what run.json and the training checkpoints record)."""
    return dataclasses.asdict(config)
