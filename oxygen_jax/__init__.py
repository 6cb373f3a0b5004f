"""oxygen_jax: π0.5 with one prefix KV cache shared by actions and language, in pure JAX.

Public API, by concept (submodules hold the details):
"""

# Configuration
from oxygen_jax.models.pi05.config import ModelConfig, RobotConfig, model_config, oxygen_benchmark_robot, robot_config

# Parameters and checkpoints
from oxygen_jax.models.pi05.params import (
    Params, abstract_params, for_backend, init_params, stack_layers, unstack_layers,
)
from oxygen_jax.ckpts.load import LoadedModel, load_model
from oxygen_jax.ckpts.openpi import load_openpi_lora, load_openpi_norm_stats, load_openpi_params
from oxygen_jax.ckpts.orbax_io import CheckpointError
from oxygen_jax.ckpts.own import restore_params, save_params

# Backbones, action heads and several heads on one prefix (beyond π0.5)
from oxygen_jax.models.backbone import BackboneSpec
from oxygen_jax.models.pi05.spec import pi05_spec
from oxygen_jax.models.heads import HeadSpec
from oxygen_jax.models.mot import (
    ModelParams, ModelSpec, init_model, language_model, make_inputs, prefix_pass, sample_all,
)

# Language adapters (LoRA): openpi's maths, merged or served per slot on the suffix path
from oxygen_jax.models.lora import ExpertLora, LoraBank, RowAdapters
from oxygen_jax.models.pi05.lora import ModelLora, init_bank, merge, stack_adapters

# The model: prefill once, denoise from the cache
from oxygen_jax.models.pi05.observation import Observation, trim_prompt_padding
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.models.pi05.model import as_vla, compute_loss, denoise, prefill, sample_actions

# Language decoding and the unified-KV runtime
from oxygen_jax.models.decoder import LanguageDecoder
from oxygen_jax.models.vla import MultiHead
from oxygen_jax.runtime.decode import (
    DecodePool, Requests, admit, decode_burst, init_pool, make_requests, release_finished,
)
from oxygen_jax.runtime.frame import frame_step, rollout
from oxygen_jax.runtime.scheduler import Scheduler, Ticket
from oxygen_jax.runtime.engine import Engine, EngineConfig, RequestError

__all__ = [
    "ModelConfig", "RobotConfig", "model_config", "robot_config", "oxygen_benchmark_robot",
    "Params", "init_params", "abstract_params", "for_backend", "stack_layers", "unstack_layers",
    "load_openpi_params", "load_openpi_lora", "load_openpi_norm_stats", "save_params", "restore_params",
    "CheckpointError", "load_model", "LoadedModel",
    "BackboneSpec", "pi05_spec", "HeadSpec", "ModelSpec", "ModelParams", "init_model", "make_inputs", "prefix_pass",
    "sample_all", "language_model", "LanguageDecoder", "MultiHead", "as_vla",
    "ExpertLora", "ModelLora", "LoraBank", "RowAdapters", "init_bank", "merge", "stack_adapters",
    "Observation", "trim_prompt_padding", "Prefix", "prefill", "denoise", "sample_actions", "compute_loss",
    "DecodePool", "Requests", "init_pool", "make_requests", "admit", "decode_burst", "release_finished",
    "frame_step", "rollout", "Scheduler", "Ticket", "Engine", "EngineConfig", "RequestError",
]
