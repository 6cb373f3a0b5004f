"""Client samples → prompt rows of a backbone-with-heads model (`models.mot.ModelSpec`), and chunks back.

Axes (`oxygen_jax.axes`): B batch, Nc the robot's camera slots, S model image side, P prompt row length,
Ds robot state dim (native), Dh a head's state dim, Ha horizon, Ad head action dim, Da robot action dim.

The same client formats as π0.5 (`transforms.robot_inputs`: LIBERO, DROID, ALOHA); what differs is the
prompt. One row per sample, left-padded to a fixed length P so every frame has the same shapes:

    [ pad … | image tokens of camera 0 (n) | … | camera Nc-1 (n) | prompt tokens ]
      mask False                                                  the last valid token is the prompt's last

Every camera slot of the robot is in every row (a missing ALOHA wrist is a black image) so the number of
image tokens, and therefore the prefix length, never changes. n = (S / (patch · merge))² tokens per image.
The state is normalised like π0.5's (quantile, with norm stats) and zero-padded or cut to each head's Dh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from oxygen_jax.models import mot
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.mot import ModelSpec, PrefixInputs
from oxygen_jax.robots.config import RobotConfig
from oxygen_jax.robots import transforms
from oxygen_jax.robots.normalize import NormStats
from oxygen_jax.robots.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """A batch of host prompt rows (numpy) before patchifying: what robots send, stacked per step.

    Attributes:
      ids: int32 [B, P]; mask: bool [B, P]; images: uint8 [B, Nc, S, S, 3]; state: float32 [B, Ds] (normalised).
    """

    ids: np.ndarray
    mask: np.ndarray
    images: np.ndarray
    state: np.ndarray


def image_tokens(spec: ModelSpec, image_size: int) -> int:
    """Image tokens per camera for square images of `image_size` px (0 on a text-only backbone: Qwen3)."""
    vspec = spec.backbone.vision
    if vspec is None:  # a text-only backbone reads the prompt alone
        return 0
    if not isinstance(vspec, qwen3_vl.Qwen3VisionSpec):
        raise ValueError("prompt rows with images need a Qwen3-VL vision backbone (ModelSpec.backbone.vision)")
    side = vspec.patch_size * vspec.spatial_merge_size
    if image_size % side:
        raise ValueError(f"image_size must be a multiple of {side} px (patch {vspec.patch_size} x merge "
                         f"{vspec.spatial_merge_size}), got {image_size}")
    return (image_size // side) ** 2


def make_rows(robot: RobotConfig, spec: ModelSpec, tokenizer: Tokenizer, samples: Sequence[Mapping],
              norm_stats: Mapping[str, NormStats] | None = None, *, image_size: int, prompt_len: int,
              default_prompt: str | None = None) -> PromptRows:
    """Client samples → `PromptRows` (see the module docstring for the layout).

    Raises:
      ValueError naming the sample index and what is wrong (a missing key, a prompt longer than the row).
    """
    if isinstance(samples, Mapping) or len(samples) == 0:
        raise ValueError("make_rows expects a non-empty list of client sample dicts")
    n_img = image_tokens(spec, image_size)
    n_cams, b = len(robot.cameras), len(samples)
    ids, mask = np.zeros((b, prompt_len), np.int32), np.zeros((b, prompt_len), bool)
    images = np.zeros((b, n_cams, image_size, image_size, 3), np.uint8)
    states = np.zeros((b, robot.state_dim), np.float32)
    for i, sample in enumerate(samples):
        try:
            inp = transforms.robot_inputs(robot, sample, default_prompt=default_prompt)
            state = transforms.normalize_state(inp["state"], norm_stats)
        except ValueError as e:
            raise ValueError(f"sample {i}: {e}") from e
        states[i, : state.shape[0]] = state
        for c, slot in enumerate(robot.cameras):
            if inp["image_masks"][slot]:
                images[i, c] = transforms.resize_with_pad(inp["images"][slot][None], image_size, image_size)[0]
        prompt = tokenizer.encode(inp["prompt"])
        row = [spec.image_token_id] * (n_cams * n_img) + list(prompt)
        if len(row) > prompt_len:
            raise ValueError(f"sample {i}: the prompt has {len(prompt)} tokens but the row holds "
                             f"{prompt_len - n_cams * n_img} after {n_cams} x {n_img} image tokens; shorten it "
                             "or raise the prompt length")
        ids[i, prompt_len - len(row):], mask[i, prompt_len - len(row):] = row, True
    transforms.check_token_ids(ids, spec.backbone.vocab_size, "tokenizer ids")
    return PromptRows(ids=ids, mask=mask, images=images, state=states)


def stack_rows(rows: Sequence[PromptRows], batch: int) -> PromptRows:
    """Concatenates rows and pads to `batch` by repeating the first row (padding rows are never read)."""
    fields = {}
    for f in dataclasses.fields(PromptRows):
        x = np.concatenate([getattr(r, f.name) for r in rows], axis=0)
        if batch > len(x):
            x = np.concatenate([x, np.repeat(x[:1], batch - len(x), axis=0)], axis=0)
        fields[f.name] = x
    return PromptRows(**fields)


def model_inputs(spec: ModelSpec, rows: PromptRows) -> tuple[PrefixInputs, dict[str, np.ndarray]]:
    """Patchified `PrefixInputs` and head name -> state [B, Dh] for the heads with a state token."""
    images = [im for row in rows.images for im in row] if spec.backbone.vision is not None else []
    inputs = mot.make_inputs(spec, rows.ids, rows.mask, images)
    states = {}
    for h in spec.heads:
        if "state" in h.extra_tokens:
            s = np.zeros((rows.ids.shape[0], h.state_dim), np.float32)
            k = min(h.state_dim, rows.state.shape[1])
            s[:, :k] = rows.state[:, :k]
            states[h.name] = s
    return inputs, states
