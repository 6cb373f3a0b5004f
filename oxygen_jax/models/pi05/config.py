"""Frozen configuration dataclasses and their named presets.

`ModelConfig` — network dimensions (two Gemma experts + SigLIP), vocabulary, compute dtype, the prompt
attention pattern and the variant (π0.5 or π0). Presets: `tiny` (tests), `bench` (CPU benchmark size),
`pi05`. `Pi0FastConfig` — π0-FAST's one PaliGemma (SigLIP + the Gemma VLM, no action expert; presets
`fast_config`). `dtype` lives in `ModelConfig` because parameters and activations share it. The robot side of a run
(camera slots, dims, horizon, prompt) is `oxygen_jax.robots.config.RobotConfig`.

Configs are hashable and carry no arrays, so they are passed to `jax.jit` as static arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from oxygen_jax.models.vision.siglip import SiglipConfig

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
_MODEL_PRESETS["pi0"] = lambda: dataclasses.replace(_MODEL_PRESETS["pi05"](), variant="pi0")  # openpi's π0 at full size
_MODEL_PRESETS["pi0_tiny"] = lambda: dataclasses.replace(_MODEL_PRESETS["tiny"](), variant="pi0")
ModelPreset = Literal["tiny", "bench", "pi05", "pi0", "pi0_tiny"]


def model_config(name: str, **overrides) -> ModelConfig:
    """Returns the model preset `name` ('tiny', 'bench', 'pi05', or π0's 'pi0' / 'pi0_tiny') with optional field
    overrides."""
    if name not in _MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(_MODEL_PRESETS)}")
    return dataclasses.replace(_MODEL_PRESETS[name](), **overrides)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class Pi0FastConfig:
    """π0-FAST (openpi's `Pi0FASTConfig`): one PaliGemma, SigLIP + the Gemma VLM, and no action expert.

    Its action chunks are FAST tokens the VLM decodes as text (`models.pi05.pi0_fast`); the chunk's horizon,
    action dim and FAST vocabulary belong to the codec (`robots.fast.FastCodec`), not to the network. The prompt
    prefix is bidirectional, the decoded suffix causal (openpi's only pattern, so there is no choice here).
    """

    vlm: ExpertConfig  # the Gemma VLM (with the embedder and the tied head)
    siglip: SiglipConfig
    vocab_size: int = PALIGEMMA_VOCAB_SIZE  # V: embedding rows (PaliGemma's tokenizer, FAST ids mapped inside it)
    dtype: DType = "float32"  # parameters and activations; norms/softmax/RoPE stay float32
    embed_scale_dtype: DType | None = None  # as `ModelConfig.embed_scale_dtype` (openpi's stored-dtype sqrt(D))
    variant: Literal["pi0_fast"] = "pi0_fast"  # the parameter table's key (`params.openpi_paths`); fixed

    def __post_init__(self):
        _require(self.variant == "pi0_fast", f"Pi0FastConfig.variant is always 'pi0_fast', got {self.variant!r}")
        _require(self.dtype in ("float32", "bfloat16"), f"Pi0FastConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        _require(self.embed_scale_dtype in (None, "float32", "bfloat16"),
                 f"Pi0FastConfig.embed_scale_dtype must be None, 'float32' or 'bfloat16', got {self.embed_scale_dtype!r}")
        _require(self.vocab_size > 3, "Pi0FastConfig.vocab_size must hold pad/eos/bos/unk")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> "Pi0FastConfig":
        return dataclasses.replace(self, **changes)


_FAST_PRESETS = {  # openpi's Pi0FASTConfig: PaliGemma gemma_2b + So400m/14; tiny: the VLM and SigLIP of "tiny"
    "pi0_fast": lambda: Pi0FastConfig(vlm=_MODEL_PRESETS["pi05"]().vlm, siglip=_MODEL_PRESETS["pi05"]().siglip),
    "pi0_fast_tiny": lambda: Pi0FastConfig(vlm=_MODEL_PRESETS["tiny"]().vlm, siglip=_MODEL_PRESETS["tiny"]().siglip,
                                           vocab_size=_MODEL_PRESETS["tiny"]().vocab_size),
}


def fast_config(name: str, **overrides) -> Pi0FastConfig:
    """The π0-FAST preset `name` ('pi0_fast' full size, 'pi0_fast_tiny' for tests) with optional field overrides."""
    if name not in _FAST_PRESETS:
        raise ValueError(f"unknown π0-FAST preset {name!r}; choose one of {sorted(_FAST_PRESETS)}")
    return dataclasses.replace(_FAST_PRESETS[name](), **overrides)
