"""A LIBERO (robosuite) observation as openpi's LIBERO client sends it: both cameras rotated 180°, and
the 8-dim state [eef xyz (3), eef axis-angle (3), gripper finger qpos (2)].

Used by the closed-loop client (`eval.serving.libero_client`) and by the frame generator (`training.data.libero`), so
the frames a model is trained on and the frames it is served are built the same way.

Axes: H, W image height and width.
"""

from __future__ import annotations

import numpy as np

from oxygen_jax.robots.transforms import resize_with_pad

# Our camera name -> robosuite's observation key.
CAMERAS = {"image": "agentview_image", "wrist_image": "robot0_eye_in_hand_image"}


def quat_to_axis_angle(quat_xyzw: np.ndarray) -> np.ndarray:
    """Unit quaternion (x, y, z, w) -> axis * angle [3] (zeros for the identity), as openpi's example."""
    w = float(np.clip(quat_xyzw[3], -1.0, 1.0))
    s = np.sqrt(1.0 - w * w)
    if s < 1e-8:
        return np.zeros(3)
    return np.asarray(quat_xyzw[:3], np.float64) * (2.0 * np.arccos(w) / s)


def camera_images(raw: dict) -> dict[str, np.ndarray]:
    """Both cameras of a robosuite observation, rotated 180° (robosuite renders them upside down): [H, W, 3]."""
    return {k: np.ascontiguousarray(raw[cam][::-1, ::-1]) for k, cam in CAMERAS.items()}


def eef_state(raw: dict) -> np.ndarray:
    """The 8-dim state of a robosuite observation: eef position | axis-angle | 2 gripper positions."""
    return np.concatenate(
        [raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]])


def client_observation(raw: dict, prompt: str, image_size: int = 224) -> dict:
    """A robosuite observation -> openpi's LIBERO request (images rotated 180 degrees, uint8, padded)."""
    images = camera_images(raw)
    return {
        "observation/image": resize_with_pad(images["image"].astype(np.uint8), image_size, image_size),
        "observation/wrist_image": resize_with_pad(images["wrist_image"].astype(np.uint8), image_size, image_size),
        "observation/state": eef_state(raw).astype(np.float64),
        "prompt": prompt,
    }
