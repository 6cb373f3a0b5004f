"""Per-robot host-side transforms between openpi client samples and the model (numpy, never jitted).

Axes (`oxygen_jax.axes`): B batch, Nc camera inputs (the robot's real slots `RobotConfig.cameras`, padding
slots dropped; or a checkpoint's `CameraLayout`), Px model image side, Hi/Wi client image height/width, Tp prompt tokens, Ha action
horizon, Ad padded model state/action dim (32), Ds/Da native state/action dims.

    client sample ──robot_inputs──▶ {"images": {slot: uint8 [Hi, Wi, 3]}, "image_masks": {slot: bool},
                                     "state": float32 [Ds], "prompt": str[, "actions": float32 [Ha, Da]]}
    [sample, …]   ──make_observation──▶ Observation(images float32 [B, Nc, Px, Px, 3] in [-1, 1],
                                     image_masks [B, Nc], tokens int32 [B, Tp], token_mask [B, Tp])
    model actions float [B, Ha, Ad] (normalised) ──robot_outputs──▶ float32 [B, Ha, Da]

Order (openpi's pipelines): robot inputs → delta actions → quantile normalise → resize → tokenize;
and unnormalise → absolute actions → robot outputs. So the state discretised into the π0.5 prompt is
the normalised, unpadded state, and for ALOHA it is the state *after* `adapt_to_pi`.

Client formats (openpi-client), and the slot each camera fills (mask):

    libero  observation/image → base (T), observation/wrist_image → left_wrist (T) (HWC uint8);
            observation/state (8); prompt. right_wrist is a padding slot (dropped).
    droid   observation/exterior_image_1_left → base (T), observation/wrist_image_left → left_wrist (T)
            (HWC uint8); observation/joint_position (7) ‖ observation/gripper_position (1); prompt.
            right_wrist is a padding slot (dropped).
    aloha   images: {cam_high → base (required), cam_left_wrist → left_wrist, cam_right_wrist →
            right_wrist, cam_low (accepted, unused)} (CHW uint8; a missing wrist → zeros, mask F;
            unknown names raise); state (14); prompt optional.

A checkpoint may feed its camera inputs otherwise (`CameraLayout`, carried by `robots.io.RobotIO`): openpi's
π0-FAST configs feed the padding camera as an unmasked black image in a robot-specific order (DROID: base,
black, wrist; LIBERO: base, wrist, black), and its attention reads those tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from PIL import Image

from oxygen_jax.models.pi05.config import ModelConfig

from oxygen_jax.robots.config import CAMERA_SLOTS, RobotConfig
from oxygen_jax.models.backbone import BackboneSpec
from oxygen_jax.robots.normalize import (
    NormStats, quantile_normalize, quantile_unnormalize, zscore_normalize, zscore_unnormalize,
)
from oxygen_jax.models.pi05.observation import Observation
from oxygen_jax.robots.tokenizer import Tokenizer, tokenize_action_prompt

_BASE, _LEFT, _RIGHT = CAMERA_SLOTS

ZEROS = "zeros"
"""A `CameraLayout` input fed a black image (openpi's padding camera: `np.zeros_like(base_image)`)."""


@dataclasses.dataclass(frozen=True)
class CameraLayout:
    """Which image fills each camera input of the prefix, in prefix order (the default, None where it is taken:
    the robot's real slots `RobotConfig.cameras`, padding dropped).

    Attributes:
      slots: each a robot camera slot (one of `RobotConfig.cameras`) or `ZEROS`: a black image the size of the
        sample's first real camera, mapped by the checkpoint's own `pixels` (openpi's: all -1).
      padding_mask: the image mask of a `ZEROS` input (openpi's π0-FAST: True, so its tokens are attended to).

    Example: openpi's π0-FAST DROID, `CameraLayout(("base_0_rgb", ZEROS, "left_wrist_0_rgb"))`: images
    [B, 3, Px, Px, 3] = exterior, black, wrist, image_masks all True.
    """

    slots: tuple[str, ...]
    padding_mask: bool = True

    def __post_init__(self):
        unknown = [s for s in self.slots if s not in CAMERA_SLOTS + (ZEROS,)]
        if unknown or not set(self.slots) - {ZEROS}:
            raise ValueError(f"CameraLayout slots {self.slots} need at least one camera slot, each of "
                             f"{CAMERA_SLOTS} or {ZEROS!r}")

    def check(self, robot: RobotConfig) -> None:
        """ValueError when a slot is not one of `robot`'s real cameras."""
        missing = [s for s in self.slots if s != ZEROS and s not in robot.cameras]
        if missing:
            raise ValueError(f"the checkpoint's camera layout {self.slots} reads slots {missing} that robot "
                             f"{robot.name!r} does not fill (its cameras: {robot.cameras}); serve it with another --robot")

# -------------------------------------------------------------------------------------------------
# Images
# -------------------------------------------------------------------------------------------------


def _resize_bilinear(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """One [Hi, Wi, c] image → [height, width, c] with PIL's bilinear filter (antialiased when shrinking)."""
    if img.dtype == np.uint8 and img.shape[-1] == 3:
        return np.asarray(Image.fromarray(img).resize((width, height), Image.BILINEAR))
    chans = []
    for k in range(img.shape[-1]):
        channel = Image.fromarray(np.ascontiguousarray(img[..., k], np.float32))  # mode "F"
        chans.append(np.asarray(channel.resize((width, height), Image.BILINEAR)))
    out = np.stack(chans, axis=-1)
    if img.dtype == np.uint8:
        out = np.clip(np.round(out), 0, 255)
    return out.astype(img.dtype)


def resize_with_pad(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """Aspect-preserving bilinear resize into `height`×`width`, centred, padded with 0 (uint8) or -1 (float).

    The scale is set by the tighter side; the other side is padded (extra pixel at the bottom/right).
    Example: a 480×640 image into 224×224 is resized to 168×224 and padded with 28 rows above and below.

    Args:
      images: uint8 or float [..., H, W, c].
    Returns:
      [..., height, width, c], same dtype.
    """
    images = np.asarray(images)
    if images.ndim < 3:
        raise ValueError(f"resize_with_pad expects images [..., H, W, channels], got shape {images.shape}")
    if images.dtype != np.uint8 and not np.issubdtype(images.dtype, np.floating):
        raise ValueError(f"resize_with_pad expects uint8 or float images, got dtype {images.dtype}")
    h, w, c = images.shape[-3:]
    if (h, w) == (height, width):
        return images.copy()
    if min(h, w, height, width) <= 0:
        raise ValueError(f"cannot resize a {h}×{w} image to {height}×{width}")
    ratio = max(w / width, h / height)
    rh, rw = max(1, min(height, int(h / ratio))), max(1, min(width, int(w / ratio)))
    top, left = (height - rh) // 2, (width - rw) // 2
    flat = images.reshape(-1, h, w, c)
    out = np.full((flat.shape[0], height, width, c), 0 if images.dtype == np.uint8 else -1, images.dtype)
    for i, img in enumerate(flat):
        out[i, top : top + rh, left : left + rw] = _resize_bilinear(img, rh, rw)
    return out.reshape(images.shape[:-3] + (height, width, c))


def _parse_image(sample: Mapping, key: str, layout: str, *, where: str = "") -> np.ndarray:
    """Reads `sample[key]` as one RGB image and returns it HWC uint8 (floats in [0, 1] are scaled as openpi does)."""
    name = f"{where}{key}"
    if key not in sample:
        raise ValueError(f"missing camera image {name!r} (expected a {layout} uint8 image)")
    arr = np.asarray(sample[key])
    expected = "[3, Hi, Wi] (CHW)" if layout == "CHW" else "[Hi, Wi, 3] (HWC)"
    if arr.ndim != 3:
        raise ValueError(f"{name}: expected a {expected} image, got shape {arr.shape}")
    if layout == "CHW":
        if arr.shape[0] != 3:
            raise ValueError(f"{name}: expected a {expected} image, got shape {arr.shape}")
        arr = arr.transpose(1, 2, 0)
    elif arr.shape[-1] != 3:
        if arr.shape[0] != 3:
            raise ValueError(f"{name}: expected a {expected} image, got shape {arr.shape}")
        arr = arr.transpose(1, 2, 0)  # openpi also accepts CHW for HWC robots
    if 0 in arr.shape:
        raise ValueError(f"{name}: empty image of shape {arr.shape}")
    if np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all() or arr.min() < 0 or arr.max() > 1:
            raise ValueError(f"{name}: float images must be finite and in [0, 1]; send uint8 pixels instead")
        arr = (255 * arr).astype(np.uint8)  # openpi-client's convert_to_uint8 (truncates)
    elif arr.dtype != np.uint8:
        raise ValueError(f"{name}: expected uint8 pixels, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr)


def to_model_pixels(img: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [-1, 1] (x / 255 * 2 - 1, openpi's)."""
    return img.astype(np.float32) / 255.0 * 2.0 - 1.0


# -------------------------------------------------------------------------------------------------
# States, actions, prompts
# -------------------------------------------------------------------------------------------------


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _parse_vector(sample: Mapping, key: str, dim: int, what: str) -> np.ndarray:
    if key not in sample:
        raise ValueError(f"missing {key!r} ({what}, {dim} numbers)")
    try:
        arr = np.asarray(sample[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected {dim} numbers ({what}), got {type(sample[key]).__name__}") from None
    if arr.ndim == 0 and dim == 1:
        arr = arr[None]  # e.g. DROID's gripper position sent as a scalar
    if arr.shape != (dim,):
        raise ValueError(f"{key}: expected {what} of shape ({dim},), got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{key}: {what} contains NaN or inf: {arr.tolist()}")
    if np.abs(arr).max(initial=0.0) > _FLOAT32_MAX:  # finite in float64, inf in the float32 model
        raise ValueError(f"{key}: {what} holds values beyond float32 (|x| > {_FLOAT32_MAX:.3g}): {arr.tolist()}")
    return arr


def _parse_prompt(sample: Mapping, default_prompt: str | None) -> str:
    prompt = sample.get("prompt")
    if prompt is None:
        if default_prompt is None:
            raise ValueError("missing 'prompt' (the task instruction string) and no default_prompt was given")
        prompt = default_prompt
    if isinstance(prompt, bytes):
        prompt = prompt.decode("utf-8")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt: expected a str, got {type(prompt).__name__}")
    return str(prompt)


def _normalizer(norm_stats: Mapping[str, NormStats], key: str) -> NormStats:
    if key not in norm_stats:
        raise ValueError(
            f"norm_stats has no {key!r} entry (has {sorted(norm_stats)}); check the asset's norm_stats.json"
        )
    return norm_stats[key]


# -------------------------------------------------------------------------------------------------
# ALOHA adapt_to_pi (openpi's `policies/aloha_policy.py` semantics, written from the spec)
# -------------------------------------------------------------------------------------------------

# Joint sign convention of π's internal ALOHA runtime; self-inverse.
_ALOHA_FLIP = np.array([1, -1, -1, 1, 1, 1, 1] * 2, np.float64)
_ALOHA_GRIPPERS = [6, 13]
# Delta actions: 6 joints relative to the state, gripper absolute, per arm.
_ALOHA_DELTA_MASK = np.array(([True] * 6 + [False]) * 2)


def _unit(x, lo, hi):
    return (x - lo) / (hi - lo)


def _from_unit(x, lo, hi):
    return x * (hi - lo) + lo


def _aloha_gripper_to_angular(x: np.ndarray) -> np.ndarray:
    # Normalised linear gripper position → horn angle (arm a = 0.036, horn radius r = 0.022) → π's range.
    lin = _from_unit(x, 0.01844, 0.05800)
    a, r = 0.036, 0.022
    with np.errstate(divide="ignore", invalid="ignore"):
        angle = np.arcsin(np.clip((r**2 + lin**2 - a**2) / (2 * r * lin), -1.0, 1.0))
    return _unit(angle, 0.5476, 1.6296)


def _aloha_state_to_pi(state: np.ndarray) -> np.ndarray:
    """Client ALOHA state [..., 14] → π convention (joint flips, gripper to angular)."""
    x = np.asarray(state, np.float64) * _ALOHA_FLIP
    x[..., _ALOHA_GRIPPERS] = _aloha_gripper_to_angular(x[..., _ALOHA_GRIPPERS])
    return x


def _aloha_actions_from_pi(actions: np.ndarray) -> np.ndarray:
    """Absolute actions in π convention [..., 14] → client ALOHA commands."""
    x = np.asarray(actions, np.float64) * _ALOHA_FLIP
    x[..., _ALOHA_GRIPPERS] = _unit(x[..., _ALOHA_GRIPPERS] + 0.5476, -0.6213, 1.4910)
    return x


def _aloha_actions_to_pi(actions: np.ndarray) -> np.ndarray:
    """Inverse of `_aloha_actions_from_pi` (training data: client commands → π convention)."""
    x = np.asarray(actions, np.float64) * _ALOHA_FLIP
    x[..., _ALOHA_GRIPPERS] = _from_unit(x[..., _ALOHA_GRIPPERS], -0.6213, 1.4910) - 0.5476
    return x


# -------------------------------------------------------------------------------------------------
# Per-robot input mappings: sample → (images by slot, masks by slot, state in π convention)
# -------------------------------------------------------------------------------------------------


def _libero_inputs(robot: RobotConfig, sample: Mapping):
    base = _parse_image(sample, "observation/image", "HWC")
    wrist = _parse_image(sample, "observation/wrist_image", "HWC")
    state = _parse_vector(sample, "observation/state", robot.state_dim, "the LIBERO eef pose + gripper state")
    images = {_BASE: base, _LEFT: wrist, _RIGHT: np.zeros_like(base)}
    return images, {_BASE: True, _LEFT: True, _RIGHT: False}, state


def _droid_inputs(robot: RobotConfig, sample: Mapping):
    base = _parse_image(sample, "observation/exterior_image_1_left", "HWC")
    wrist = _parse_image(sample, "observation/wrist_image_left", "HWC")
    joints = _parse_vector(sample, "observation/joint_position", robot.state_dim - 1, "the DROID joint positions")
    gripper = _parse_vector(sample, "observation/gripper_position", 1, "the DROID gripper position")
    images = {_BASE: base, _LEFT: wrist, _RIGHT: np.zeros_like(base)}
    return images, {_BASE: True, _LEFT: True, _RIGHT: False}, np.concatenate([joints, gripper])


_ALOHA_CAMERAS = {"cam_high": _BASE, "cam_low": None, "cam_left_wrist": _LEFT, "cam_right_wrist": _RIGHT}


def _aloha_inputs(robot: RobotConfig, sample: Mapping):
    if robot.state_dim != 14 or robot.action_dim != 14:
        raise ValueError(f"ALOHA transforms need state_dim = action_dim = 14, got {robot.state_dim}/{robot.action_dim}")
    cams = sample.get("images")
    if not isinstance(cams, Mapping):
        raise ValueError(f"missing 'images' (a dict of CHW uint8 images from {sorted(_ALOHA_CAMERAS)})")
    unknown = sorted(set(cams) - set(_ALOHA_CAMERAS))
    if unknown:
        raise ValueError(f"images: unknown ALOHA camera names {unknown}; expected a subset of {sorted(_ALOHA_CAMERAS)}")
    base = _parse_image(cams, "cam_high", "CHW", where="images/")
    images, masks = {_BASE: base}, {_BASE: True}
    for name, slot in _ALOHA_CAMERAS.items():
        if slot is None or slot == _BASE:
            continue  # cam_low is accepted but π0.5 has no slot for it
        present = name in cams
        images[slot] = _parse_image(cams, name, "CHW", where="images/") if present else np.zeros_like(base)
        masks[slot] = present
    state = _parse_vector(sample, "state", 14, "the ALOHA joint state")
    return images, masks, _aloha_state_to_pi(state)


_INPUTS = {"libero": _libero_inputs, "droid": _droid_inputs, "aloha": _aloha_inputs}


def _robot_kind(robot: RobotConfig) -> str:
    if robot.name not in _INPUTS:
        raise ValueError(f"no input/output transforms for robot {robot.name!r}; known robots: {sorted(_INPUTS)}")
    return robot.name


def _input_actions(robot: RobotConfig, actions, state_pi: np.ndarray) -> np.ndarray:
    """Training actions [Ha, Da] in client convention → π convention, delta joints for ALOHA."""
    try:
        a = np.asarray(actions, np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"actions: expected numbers [horizon, {robot.action_dim}], got {type(actions).__name__}"
        ) from None
    if a.ndim != 2 or a.shape[-1] != robot.action_dim:
        raise ValueError(f"actions: expected shape [horizon, {robot.action_dim}], got {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("actions: contain NaN or inf")
    if robot.name == "aloha":
        a = _aloha_actions_to_pi(a)
        a[..., _ALOHA_DELTA_MASK] -= state_pi[_ALOHA_DELTA_MASK]
    return a.astype(np.float32)


# -------------------------------------------------------------------------------------------------
# Public API
# -------------------------------------------------------------------------------------------------


def robot_inputs(robot: RobotConfig, sample: Mapping, *, default_prompt: str | None = None) -> dict:
    """Maps one client sample to per-slot images and masks, the state and the prompt.

    Args:
      robot: which client format to read (`robot.name` ∈ libero, droid, aloha).
      sample: one client observation (see the module docstring for the keys). An optional "actions"
        [Ha, Da] entry (training data) is converted too: ALOHA actions go to π convention with delta joints.
      default_prompt: used when the sample has no "prompt".
    Returns:
      {"images": {slot: uint8 [Hi, Wi, 3]}, "image_masks": {slot: bool}} for the slots in `robot.cameras`,
      "state": float32 [Ds] (native dims, π convention: ALOHA after adapt_to_pi, unnormalised),
      "prompt": str, and "actions": float32 [Ha, Da] if the sample had actions.
    Raises:
      ValueError naming the missing or malformed key and what was expected.
    """
    kind = _robot_kind(robot)
    if not isinstance(sample, Mapping):
        raise ValueError(f"a client sample must be a dict, got {type(sample).__name__}")
    images, masks, state = _INPUTS[kind](robot, sample)
    out = {
        "images": {c: images[c] for c in robot.cameras},
        "image_masks": {c: bool(masks[c]) for c in robot.cameras},
        "state": state.astype(np.float32),
        "prompt": _parse_prompt(sample, default_prompt),
    }
    if sample.get("actions") is not None:
        out["actions"] = _input_actions(robot, sample["actions"], state)
    return out


def client_state(robot: RobotConfig, sample: Mapping) -> np.ndarray:
    """The robot's native state as the client sent it, float64 [Ds] (what `robot_outputs` takes as a state).

    DROID: joint_position ‖ gripper_position; LIBERO: observation/state; ALOHA: state (before adapt_to_pi).
    """
    kind = _robot_kind(robot)
    if kind == "libero":
        return _parse_vector(sample, "observation/state", robot.state_dim, "the LIBERO state")
    if kind == "droid":
        joints = _parse_vector(sample, "observation/joint_position", robot.state_dim - 1, "the DROID joint positions")
        gripper = _parse_vector(sample, "observation/gripper_position", 1, "the DROID gripper position")
        return np.concatenate([joints, gripper])
    return _parse_vector(sample, "state", robot.state_dim, "the ALOHA joint state")


def normalize_state(state: np.ndarray, norm_stats: Mapping[str, NormStats] | None, *, quantile: bool = True) -> np.ndarray:
    """The robot state as the model sees it: quantile (π0.5) or z-score normalised with norm_stats["state"];
    unchanged without norm stats. Raises ValueError when the stats have no "state" entry, or when the normalised
    state is not finite in float32 (the model's dtype)."""
    if norm_stats is None:
        return state
    stats = _normalizer(norm_stats, "state")
    with np.errstate(over="ignore", invalid="ignore"):
        out = quantile_normalize(state, stats) if quantile else zscore_normalize(state, stats)
    if not np.isfinite(out).all():  # e.g. 1e38 over a narrow quantile range: inf in float32
        raise ValueError(f"state: normalising {np.asarray(state).tolist()} with the checkpoint's state statistics "
                         "gives values beyond float32; send the robot's raw state in its own units")
    return out


def unnormalize_actions(actions: np.ndarray, norm_stats: Mapping[str, NormStats] | None, *,
                        quantile: bool = True) -> np.ndarray:
    """Normalised model actions [..., Ad] in robot units with norm_stats["actions"] (quantile, or z-score with
    `quantile=False`; the dims beyond the statistics pass); unchanged without norm stats."""
    if norm_stats is None:
        return actions
    stats = _normalizer(norm_stats, "actions")
    return quantile_unnormalize(actions, stats) if quantile else zscore_unnormalize(actions, stats)


def make_observation(
    robot: RobotConfig,
    model_config: ModelConfig | BackboneSpec,
    tokenizer: Tokenizer,
    samples: Sequence[Mapping],
    norm_stats: Mapping[str, NormStats] | None = None,
    *,
    default_prompt: str | None = None,
    quantile: bool = True,
) -> Observation:
    """Batches client samples into the model's `Observation` with openpi's conventions (numpy arrays; the
    caller places them on device). A checkpoint's own conventions: `robots.io.observation_rows`.

    `model_config`: π0.5's `ModelConfig` or a SigLIP backbone's `BackboneSpec` (its image size and vocabulary).
    Per sample: `robot_inputs`; each real camera slot resized with pad to Px = the SigLIP image size
    and mapped uint8 → x/255·2−1; the state normalised with norm_stats["state"] (quantile, or z-score with
    `quantile=False`) when `norm_stats` is given; the prompt tokenized to `robot.max_token_len`, in the π0.5
    format with the discretised state if `robot.discrete_state_input`, else the π0 format.

    Returns:
      Observation(images float32 [B, Nc, Px, Px, 3], image_masks bool [B, Nc], tokens int32 [B, Tp], token_mask bool [B, Tp]).
    Raises:
      ValueError naming the sample index and the key at fault.
    """
    vision = model_config.siglip if isinstance(model_config, ModelConfig) else model_config.vision
    obs, _ = observation_arrays(
        robot, vision.image_size, model_config.vocab_size, samples, default_prompt=default_prompt,
        normalize=lambda x: normalize_state(x, norm_stats, quantile=quantile),
        pixels=lambda im, size: to_model_pixels(resize_with_pad(im, size, size)),
        prompt=lambda task, state, t: tokenize_action_prompt(tokenizer, task, state if robot.discrete_state_input else None,
                                                             t))
    return obs


def observation_arrays(robot: RobotConfig, image_size: int, vocab_size: int, samples: Sequence[Mapping], *,
                       normalize: Callable, pixels: Callable, prompt: Callable, default_prompt: str | None = None,
                       state_dim: int = 0, cameras: CameraLayout | None = None) -> tuple[Observation, np.ndarray | None]:
    """The batching loop of every convention: per sample `robot_inputs`, then `normalize(state [Ds])`, `pixels(uint8
    image, Px)` per camera input and `prompt(task, normalised state, Tp) -> (ids, mask)`.

    `cameras`: the checkpoint's `CameraLayout` (None: the robot's real slots, padding dropped).

    Returns:
      (Observation, states float32 [B, state_dim]: the normalised states zero-padded, or None when state_dim is 0).
    Raises:
      ValueError naming the sample index and the key at fault.
    """
    if isinstance(samples, Mapping) or len(samples) == 0:
        raise ValueError("make_observation expects a non-empty list of client sample dicts")
    if cameras is not None:
        cameras.check(robot)
    slots = robot.cameras if cameras is None else cameras.slots
    real = next(s for s in slots if s != ZEROS)
    b_size, c_size, t = len(samples), len(slots), robot.max_token_len
    images = np.empty((b_size, c_size, image_size, image_size, 3), np.float32)
    image_masks = np.empty((b_size, c_size), bool)
    tokens = np.empty((b_size, t), np.int32)
    token_mask = np.empty((b_size, t), bool)
    states = np.zeros((b_size, state_dim), np.float32) if state_dim else None
    for b, sample in enumerate(samples):
        try:
            inp = robot_inputs(robot, sample, default_prompt=default_prompt)
            state = normalize(inp["state"])
            if states is not None:
                if state.shape[-1] > state_dim:
                    raise ValueError(f"the state has {state.shape[-1]} dims but the model's state input has {state_dim}")
                states[b, : state.shape[-1]] = state
        except ValueError as e:
            raise ValueError(f"sample {b}: {e}") from e
        for c, slot in enumerate(slots):
            if slot == ZEROS:
                images[b, c] = pixels(np.zeros_like(inp["images"][real]), image_size)
                image_masks[b, c] = cameras.padding_mask
            else:
                images[b, c] = pixels(inp["images"][slot], image_size)
                image_masks[b, c] = inp["image_masks"][slot]
        tokens[b], token_mask[b] = prompt(inp["prompt"], state, t)
    check_token_ids(tokens, vocab_size, "tokenizer ids")
    return Observation(images=images, image_masks=image_masks, tokens=tokens, token_mask=token_mask), states


def check_token_ids(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Refuse ids the model's embedding has no row for (JAX would clamp the gather silently)."""
    if tokens.size and tokens.max() >= vocab_size:
        raise ValueError(
            f"{what} reach {tokens.max()} but the model vocabulary has {vocab_size} entries; "
            "use a tokenizer that matches the model"
        )

def robot_outputs(
    robot: RobotConfig,
    actions: np.ndarray,
    states_native: np.ndarray | None = None,
    norm_stats: Mapping[str, NormStats] | None = None,
    *,
    quantile: bool = True,
) -> np.ndarray:
    """Model actions → robot commands: unnormalise, ALOHA delta → absolute and back to client convention, slice.

    Args:
      robot: the robot whose commands to produce.
      actions: float [B, Ha, Ad] or [Ha, Ad], normalised model output (Ad >= robot.action_dim).
      states_native: the client states `client_state(robot, sample)`, [B, Ds] or [Ds]. Required for ALOHA
        (delta joint actions are relative to the state); unused otherwise.
      norm_stats: {"actions": NormStats, ...}; None skips unnormalisation (actions already unnormalised).
      quantile: quantile (π0.5) or z-score (π0) unnormalisation.
    Returns:
      float32 [B, Ha, Da] or [Ha, Da].

    Example (ALOHA): zero delta actions hold the current pose — the 12 joint outputs equal the client state.
    """
    kind = _robot_kind(robot)
    a = np.asarray(actions, np.float64)
    if a.ndim not in (2, 3) or a.shape[-1] < robot.action_dim:
        raise ValueError(
            f"actions must be [batch, horizon, >= {robot.action_dim}] or [horizon, ...], got shape {a.shape}"
        )
    a = unnormalize_actions(a, norm_stats, quantile=quantile)
    if kind != "aloha":
        return a[..., : robot.action_dim].astype(np.float32)
    if states_native is None:
        raise ValueError(
            "ALOHA outputs need states_native (the client 'state') to turn delta joint actions into absolute ones"
        )
    st = np.asarray(states_native, np.float64)
    if st.shape != a.shape[:-2] + (14,):
        raise ValueError(f"states_native: expected shape {a.shape[:-2] + (14,)} for actions {a.shape}, got {st.shape}")
    a = a[..., :14] + np.where(_ALOHA_DELTA_MASK, _aloha_state_to_pi(st), 0.0)[..., None, :]
    return _aloha_actions_from_pi(a).astype(np.float32)


def synthetic_sample(
    robot: RobotConfig, rng: np.random.Generator, prompt: str = "pick the red cup", image_size: int = 224
) -> dict:
    """A client-format sample with uniform random uint8 images and a standard-normal state (demos, benchmarks)."""
    kind = _robot_kind(robot)
    hwc = lambda: rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)  # noqa: E731
    if kind == "libero":
        return {
            "observation/image": hwc(),
            "observation/wrist_image": hwc(),
            "observation/state": rng.standard_normal(robot.state_dim).astype(np.float32),
            "prompt": prompt,
        }
    if kind == "droid":
        return {
            "observation/exterior_image_1_left": hwc(),
            "observation/wrist_image_left": hwc(),
            "observation/joint_position": rng.standard_normal(robot.state_dim - 1).astype(np.float32),
            "observation/gripper_position": rng.standard_normal(1).astype(np.float32),
            "prompt": prompt,
        }
    return {
        "state": rng.standard_normal(robot.state_dim).astype(np.float32),
        "images": {name: hwc().transpose(2, 0, 1).copy() for name in _ALOHA_CAMERAS},
        "prompt": prompt,
    }
