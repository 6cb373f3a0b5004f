"""A robot workload: its camera slots, state / action dims, horizon and prompt (openpi's serving configs).

`RobotConfig` presets: `libero`, `droid`, `aloha` (`robot_config`), and the OxyGen paper's benchmark variant
(`oxygen_benchmark_robot`). What a *checkpoint* says about its robot I/O (tokenizer, normalisation, how the
state enters) is `oxygen_jax.robots.io.RobotIO`; a `RobotConfig` is what the robot on the other end sends.

Hashable and free of arrays, like the model configs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

CAMERA_SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
"""The three image slots of openpi's π models, in prefix order."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RobotConfig:
    """A robot workload: camera slots, dimensions and prompt format (openpi's serving configs)."""

    name: str
    cameras: tuple[str, ...]  # slots encoded into the prefix, in prefix order (subset of CAMERA_SLOTS)
    padding_cameras: tuple[str, ...]  # slots openpi fills with zeros + mask False; dropped here
    state_dim: int  # native robot state dimension
    action_dim: int  # native robot action dimension (output of the output transform)
    model_action_dim: int = 32  # padded state/action dimension of the model
    action_horizon: int  # Ha: actions per chunk
    max_token_len: int  # prompt tokens in the prefix (padded/truncated to this)
    discrete_state_input: bool  # π0.5 prompt with discretised state ("Task: …, State: …;\nAction: ")
    control_hz: float  # nominal control rate, for reporting

    def __post_init__(self):
        unknown = [c for c in self.cameras + self.padding_cameras if c not in CAMERA_SLOTS]
        _require(not unknown, f"RobotConfig {self.name!r}: unknown camera slots {unknown}; valid: {CAMERA_SLOTS}")
        _require(len(self.cameras) > 0, f"RobotConfig {self.name!r}: needs at least one real camera")
        _require(
            not set(self.cameras) & set(self.padding_cameras),
            f"RobotConfig {self.name!r}: a camera cannot be both real and padding",
        )
        order = [CAMERA_SLOTS.index(c) for c in self.cameras]
        _require(order == sorted(order), f"RobotConfig {self.name!r}: cameras must follow the slot order {CAMERA_SLOTS}")
        _require(self.action_dim <= self.model_action_dim, "RobotConfig.action_dim exceeds model_action_dim")
        _require(self.state_dim <= self.model_action_dim, "RobotConfig.state_dim exceeds model_action_dim")
        _require(self.action_horizon > 0 and self.max_token_len > 0, "RobotConfig: horizon and max_token_len must be > 0")

    @property
    def num_cameras(self) -> int:
        return len(self.cameras)

    def replace(self, **changes) -> "RobotConfig":
        return dataclasses.replace(self, **changes)


_ROBOT_PRESETS = {
    # pi05_libero: base <- third-person image, left wrist <- wrist image, right wrist is padding.
    # The state is not in the prompt (openpi uses the π0 prompt format for this config).
    "libero": lambda: RobotConfig(
        name="libero", cameras=("base_0_rgb", "left_wrist_0_rgb"), padding_cameras=("right_wrist_0_rgb",),
        state_dim=8, action_dim=7, action_horizon=10, max_token_len=200, discrete_state_input=False,
        control_hz=10.0,
    ),
    "droid": lambda: RobotConfig(
        name="droid", cameras=("base_0_rgb", "left_wrist_0_rgb"), padding_cameras=("right_wrist_0_rgb",),
        state_dim=8, action_dim=8, action_horizon=15, max_token_len=200, discrete_state_input=True,
        control_hz=15.0,
    ),
    # ALOHA: all three slots are real; a missing wrist camera is masked per row.
    "aloha": lambda: RobotConfig(
        name="aloha", cameras=CAMERA_SLOTS, padding_cameras=(), state_dim=14, action_dim=14,
        action_horizon=50, max_token_len=200, discrete_state_input=True, control_hz=50.0,
    ),
}
RobotPreset = Literal["libero", "droid", "aloha"]


def robot_config(name: str, **overrides) -> RobotConfig:
    """Returns the robot preset `name` ('libero', 'droid' or 'aloha') with optional field overrides."""
    if name not in _ROBOT_PRESETS:
        raise ValueError(f"unknown robot preset {name!r}; choose one of {sorted(_ROBOT_PRESETS)}")
    return dataclasses.replace(_ROBOT_PRESETS[name](), **overrides)


def oxygen_benchmark_robot(name: str) -> RobotConfig:
    """The OxyGen paper's benchmark variant of a robot preset: Ha = 10, 100 prompt tokens (P = 868)."""
    return robot_config(name, action_horizon=10, max_token_len=100)
