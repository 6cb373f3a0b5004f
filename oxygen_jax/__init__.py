"""oxygen_jax: π0.5 with one prefix KV cache shared by actions and language, in pure JAX.

Public API, by concept (submodules hold the details). The names below are resolved on first use
(PEP 562 module `__getattr__`), so `import oxygen_jax.client` on a robot machine loads numpy only, never
jax: `oxygen_jax.Engine` or `from oxygen_jax import Engine` imports the runtime at that moment.
"""

import importlib

# public name -> the module that defines it, in commented groups
_EXPORTS = {
    # Configuration
    **dict.fromkeys(("ModelConfig", "model_config"), "oxygen_jax.models.pi05.config"),
    **dict.fromkeys(("RobotConfig", "robot_config", "oxygen_benchmark_robot"), "oxygen_jax.robots.config"),
    # Parameters and checkpoints
    **dict.fromkeys(("Params", "init_params", "abstract_params", "for_backend", "stack_layers", "unstack_layers"),
                    "oxygen_jax.models.pi05.params"),
    **dict.fromkeys(("load_openpi_params", "load_openpi_lora", "load_openpi_norm_stats"), "oxygen_jax.ckpts.openpi"),
    **dict.fromkeys(("save_params", "restore_params"), "oxygen_jax.ckpts.own"),
    "CheckpointError": "oxygen_jax.ckpts.orbax_io",
    **dict.fromkeys(("load_model", "LoadedModel"), "oxygen_jax.ckpts.load"),
    # Backbones, action heads and several heads on one prefix (beyond π0.5)
    "BackboneSpec": "oxygen_jax.models.backbone",
    "pi05_spec": "oxygen_jax.models.pi05.spec",
    "HeadSpec": "oxygen_jax.models.heads",
    **dict.fromkeys(("ModelSpec", "ModelParams", "init_model", "make_inputs", "prefix_pass", "sample_all",
                     "language_model"), "oxygen_jax.models.mot"),
    # Language adapters (LoRA): openpi's maths, merged or served per slot on the suffix path
    **dict.fromkeys(("ExpertLora", "LoraBank", "RowAdapters"), "oxygen_jax.models.lora"),
    **dict.fromkeys(("ModelLora", "init_bank", "merge", "stack_adapters"), "oxygen_jax.models.pi05.lora"),
    # The model: prefill once, denoise from the cache
    **dict.fromkeys(("Observation", "trim_prompt_padding"), "oxygen_jax.models.pi05.observation"),
    "Prefix": "oxygen_jax.models.prefix",
    **dict.fromkeys(("prefill", "denoise", "sample_actions", "compute_loss", "as_vla"), "oxygen_jax.models.pi05.model"),
    # Language decoding and the unified-KV runtime
    "LanguageDecoder": "oxygen_jax.models.decoder",
    "MultiHead": "oxygen_jax.models.vla",
    **dict.fromkeys(("DecodePool", "Requests", "init_pool", "make_requests", "admit", "decode_burst",
                     "release_finished"), "oxygen_jax.runtime.decode"),
    **dict.fromkeys(("frame_step", "rollout"), "oxygen_jax.runtime.frame"),
    **dict.fromkeys(("Scheduler", "Ticket"), "oxygen_jax.runtime.scheduler"),
    **dict.fromkeys(("Engine", "EngineConfig", "RequestError"), "oxygen_jax.runtime.engine"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Imports the module behind a public name on first access and keeps the value (later reads are plain)."""
    if name not in _EXPORTS:
        # AttributeError (not ImportError) lets `from oxygen_jax import run` fall through to the submodule.
        raise AttributeError(f"module 'oxygen_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
