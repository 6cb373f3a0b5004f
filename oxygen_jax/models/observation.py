"""The observation a SigLIP prefix pass reads: camera images, their masks and the tokenized prompt.

Axes (`oxygen_jax.axes`): B batch, Nc present cameras (the robot's real camera slots, padding slots
already dropped), Px image side in pixels, Tp prompt tokens.

    images      float [B, Nc, Px, Px, 3]  in [-1, 1] (compute dtype or float32)
    image_masks bool  [B, Nc]             False = this camera is absent for this row (masked, not dropped)
    tokens      int32 [B, Tp]             prompt ids, 0-padded
    token_mask  bool  [B, Tp]             True on real prompt tokens

This is the input kind of every `mot.ModelSpec` whose backbone has a `SiglipConfig` vision encoder
(π0.5; `models.vision.siglip_prefix`); `oxygen_jax.robots.transforms` builds it from robot (client)
dictionaries. `models.pi05.observation` re-exports it with π0.5's config-based check.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Observation:
    images: jax.Array
    image_masks: jax.Array
    tokens: jax.Array
    token_mask: jax.Array

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_cameras(self) -> int:
        return self.images.shape[1]


def validate(obs: Observation, *, image_size: int, vocab_size: int, num_cameras: int | None = None) -> None:
    """Raises ValueError naming the first problem with `obs` (shapes, dtypes, sizes, NaNs).

    Args:
      image_size: Px the vision encoder takes (`SiglipConfig.image_size`).
      vocab_size: token ids must lie in [0, vocab_size).
      num_cameras: if given, the camera count the robot config declares.
    Works on concrete arrays and on tracers (NaN and id-range checks only run on concrete arrays).
    """
    if not isinstance(obs, Observation):
        raise ValueError(f"expected an Observation, got {type(obs).__name__}")
    im, s = obs.images, image_size
    if im.ndim != 5 or im.shape[2:] != (s, s, 3):
        raise ValueError(
            f"images must have shape [batch, cameras, {s}, {s}, 3] for this model "
            f"(SiglipConfig.image_size={s}), got {tuple(im.shape)}; resize images with transforms.resize_with_pad"
        )
    if not jnp.issubdtype(im.dtype, jnp.floating):
        raise ValueError(f"images must be floating point in [-1, 1], got dtype {im.dtype}; convert uint8 with x / 255 * 2 - 1")
    b, c = im.shape[:2]
    if num_cameras is not None and c != num_cameras:
        raise ValueError(f"images hold {c} cameras but the robot config has {num_cameras} real camera slots")
    if obs.image_masks.shape != (b, c) or obs.image_masks.dtype != jnp.bool_:
        raise ValueError(f"image_masks must be bool [{b}, {c}], got {obs.image_masks.dtype} {tuple(obs.image_masks.shape)}")
    if obs.tokens.ndim != 2 or obs.tokens.shape[0] != b:
        raise ValueError(f"tokens must be [batch={b}, prompt_len], got {tuple(obs.tokens.shape)}")
    if not jnp.issubdtype(obs.tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {obs.tokens.dtype}")
    if obs.token_mask.shape != obs.tokens.shape or obs.token_mask.dtype != jnp.bool_:
        raise ValueError(
            f"token_mask must be bool with the shape of tokens {tuple(obs.tokens.shape)}, "
            f"got {obs.token_mask.dtype} {tuple(obs.token_mask.shape)}"
        )
    if not isinstance(im, jax.core.Tracer):
        if not bool(np.isfinite(np.asarray(im, np.float32)).all()):
            raise ValueError("images contain NaN or inf")
        toks = np.asarray(obs.tokens)
        if toks.size and (toks.min() < 0 or toks.max() >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size}), got range [{toks.min()}, {toks.max()}]")


def trim_prompt_padding(obs: Observation, bucket: int = 16) -> Observation:
    """Drops prompt padding beyond the longest prompt, rounded up to a multiple of `bucket`.

    Padding tokens are masked out, so this changes no output, only the prefix length: a 14-token
    prompt padded to 100 costs 86 wasted prefix positions. Shapes change only when the longest prompt
    crosses a bucket boundary, so a jitted consumer compiles once per bucket (at most
    max_token_len / bucket programs). Host-side (numpy) helper.

    Example: token_mask rows of lengths [5, 14] in 100 slots, bucket 16 -> 16 slots.
    """
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    mask = np.asarray(obs.token_mask)
    last = int(np.max(np.nonzero(mask.any(0))[0], initial=-1)) + 1
    keep = min(mask.shape[1], max(bucket, -(-last // bucket) * bucket))
    return dataclasses.replace(obs, tokens=np.asarray(obs.tokens)[:, :keep], token_mask=mask[:, :keep])
