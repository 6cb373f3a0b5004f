"""Frozen configuration dataclasses and their named presets.

Three independent choices describe a run:

* `ModelConfig` — network dimensions (two Gemma experts + SigLIP), vocabulary, compute dtype and
  the prompt attention pattern. Presets: `tiny` (tests), `bench` (CPU benchmark size), `pi05`.
* `RobotConfig` — a workload: which camera slots are real, which are padding, state/action dims,
  action horizon, prompt length and format. Presets: `libero`, `droid`, `aloha`.
* `dtype` lives in `ModelConfig` because parameters and activations share it.

Configs are hashable and carry no arrays, so they are passed to `jax.jit` as static arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from oxygen_jax.models.siglip import SiglipConfig

CAMERA_SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
"""The three image slots of openpi's π0.5, in prefix order."""

PALIGEMMA_VOCAB_SIZE = 257_152
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

DType = Literal["float32", "bfloat16"]
PromptAttention = Literal["bidirectional", "causal"]
Variant = Literal["pi05", "pi0"]


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertConfig:
    """One Gemma expert of the mixture of transformers."""

    width: int  # D: residual width
    depth: int  # L: number of layers (must equal the other expert's)
    mlp_dim: int  # F: gated-MLP hidden size
    num_heads: int  # N: query heads
    num_kv_heads: int  # K: key/value heads (grouped-query attention; N % K == 0)
    head_dim: int  # H

    def __post_init__(self):
        for f in ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"):
            _require(getattr(self, f) > 0, f"ExpertConfig.{f} must be positive, got {getattr(self, f)}")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"ExpertConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        _require(self.head_dim % 2 == 0, f"ExpertConfig.head_dim must be even for RoPE, got {self.head_dim}")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """π0.5 or π0: VLM expert (expert 0, with embedder), action expert (expert 1), SigLIP.

    `variant` is openpi's `Pi0Config.pi05`: "pi05" conditions the action expert on the flow time through
    adaRMSNorm and reads the state as prompt tokens; "pi0" mixes the time into each action token with an MLP
    (`action_time_mlp_*`), has plain RMSNorms in both experts and reads the state as one suffix token
    (`state_proj`). Everything else (SigLIP, the VLM expert, the prefix, language decoding) is the same.
    """

    vlm: ExpertConfig
    action_expert: ExpertConfig
    siglip: SiglipConfig
    vocab_size: int = PALIGEMMA_VOCAB_SIZE
    action_dim: int = 32  # A: padded action dimension seen by the model
    dtype: DType = "float32"  # parameters and activations; norms/softmax/RoPE stay float32
    prompt_attention: PromptAttention = "bidirectional"  # openpi π0.5; "causal" = OxyGen variant
    # dtype sqrt(D_vlm) is rounded to before it scales token embeddings; None = `dtype`. openpi rounds it to the
    # embedding's stored dtype, so a training-layout checkpoint (bfloat16 table) restored in float32 sets "bfloat16".
    embed_scale_dtype: DType | None = None
    variant: Variant = "pi05"  # "pi05" (adaRMS time, state in the prompt) or "pi0" (time MLP, state token)

    def __post_init__(self):
        v, a = self.vlm, self.action_expert
        for f in ("depth", "num_heads", "num_kv_heads", "head_dim"):
            _require(
                getattr(v, f) == getattr(a, f),
                f"both experts must share {f} (they attend jointly): vlm.{f}={getattr(v, f)}, "
                f"action_expert.{f}={getattr(a, f)}",
            )
        _require(self.dtype in ("float32", "bfloat16"), f"ModelConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        _require(self.embed_scale_dtype in (None, "float32", "bfloat16"),
                 f"ModelConfig.embed_scale_dtype must be None, 'float32' or 'bfloat16', got {self.embed_scale_dtype!r}")
        _require(
            self.prompt_attention in ("bidirectional", "causal"),
            f"ModelConfig.prompt_attention must be 'bidirectional' or 'causal', got {self.prompt_attention!r}",
        )
        _require(self.vocab_size > 3, "ModelConfig.vocab_size must hold pad/eos/bos/unk")
        _require(self.variant in ("pi05", "pi0"), f"ModelConfig.variant must be 'pi05' or 'pi0', got {self.variant!r}")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_MODEL_PRESETS = {
    "pi05": lambda: ModelConfig(
        vlm=ExpertConfig(width=2048, depth=18, mlp_dim=16384, num_heads=8, num_kv_heads=1, head_dim=256),
        action_expert=ExpertConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
        siglip=SiglipConfig(width=1152, depth=27, mlp_dim=4304, num_heads=16, patch_size=14, image_size=224),
    ),
    "bench": lambda: ModelConfig(
        vlm=ExpertConfig(width=1024, depth=8, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=128),
        action_expert=ExpertConfig(width=512, depth=8, mlp_dim=2048, num_heads=8, num_kv_heads=1, head_dim=128),
        siglip=SiglipConfig(width=384, depth=6, mlp_dim=1536, num_heads=6, patch_size=14, image_size=224),
    ),
    # Small enough for CPU tests; GQA (2 KV heads) so nothing silently assumes one KV head.
    "tiny": lambda: ModelConfig(
        vlm=ExpertConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=2, head_dim=16),
        action_expert=ExpertConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=2, head_dim=16),
        siglip=SiglipConfig(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=14, image_size=56),
        vocab_size=1024,
    ),
}
ModelPreset = Literal["tiny", "bench", "pi05"]


def model_config(name: str, **overrides) -> ModelConfig:
    """Returns the model preset `name` ('tiny', 'bench' or 'pi05') with optional field overrides."""
    if name not in _MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(_MODEL_PRESETS)}")
    return dataclasses.replace(_MODEL_PRESETS[name](), **overrides)


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
