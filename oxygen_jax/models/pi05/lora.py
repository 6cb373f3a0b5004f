"""LoRA adapters of π0.5's two experts: the checkpoint's pair of adapters, merging it into `Params`, and
fresh or stacked banks of language adapters for the VLM expert.

Axes (`oxygen_jax.axes`): L layers, E adapters in a bank, r LoRA rank; the factor shapes per target
are those of `models/lora.py`'s docstring.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models.lora import (
    TARGETS, ExpertLora, LayerDims, LoraBank, LoraPair, fit_problems, merge_layers, shape_differences, target_shapes,
)
from oxygen_jax.models.pi05.config import ExpertConfig, ModelConfig
from oxygen_jax.models.pi05.params import Expert, Params

EXPERTS = (("vlm", ""), ("action_expert", "_1"))
"""(ModelLora / Params field, openpi path suffix) of the two experts."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelLora:
    """Adapters of both experts, as an openpi LoRA checkpoint holds them (None: no LoRA there)."""

    vlm: ExpertLora | None
    action_expert: ExpertLora | None


def expert_dims(expert: ExpertConfig) -> LayerDims:
    """An expert's config as the dims LoRA shapes read."""
    return LayerDims(width=expert.width, depth=expert.depth, mlp_dim=expert.mlp_dim, num_heads=expert.num_heads,
                     num_kv_heads=expert.num_kv_heads, head_dim=expert.head_dim)


def merge(params: Params, adapters: ModelLora) -> Params:
    """Base parameters with every adapter folded in: W + s·ΔW exactly as openpi's LoRA computes it
    (head-summed attn_vec, unscaled feed-forward), in float32, cast back to each weight's dtype.

    The result runs the whole-sequence LoRA openpi trains through the ordinary (LoRA-free)
    functions. Works on stacked and `Unstacked` (`params.for_backend` on CPU) parameters.
    """

    def expert(e: Expert, adapter: ExpertLora | None) -> Expert:
        return e if adapter is None else dataclasses.replace(e, layers=merge_layers(e.layers, adapter))

    return params.replace(
        vlm=expert(params.vlm, adapters.vlm), action_expert=expert(params.action_expert, adapters.action_expert)
    )


# ---------------------------------------------------------------------------------------------
# Banks
# ---------------------------------------------------------------------------------------------


def _expert_config(config: ExpertConfig | ModelConfig) -> ExpertConfig:
    return config.vlm if isinstance(config, ModelConfig) else config


def check_adapter(adapter: ExpertLora, config: ExpertConfig | ModelConfig) -> None:
    """Raises ValueError listing every leaf of `adapter` ([L, ...] leaves) that does not fit the
    expert (the VLM expert for a `ModelConfig`), or whose rank differs within its group."""
    expert = _expert_config(config)
    lines = fit_problems(adapter, expert_dims(expert), (expert.depth,))
    if lines:
        raise ValueError("LoRA adapter does not fit the expert:\n" + "\n".join(f"  {line}" for line in lines))


def stack_adapters(adapters: Sequence[ExpertLora], config: ExpertConfig | ModelConfig | None = None) -> LoraBank:
    """Stacks single adapters (leaves [L, ...]) into a bank; adapter i of the list gets id i + 1.

    All adapters must have the same targets, ranks, shapes, alpha and rslora (the bank's rank and
    scaling are static); `config`, when given, is checked too (a `ModelConfig` means its VLM expert).

    Raises:
      ValueError: naming the adapter and listing every mismatched leaf.
    """
    if not adapters:
        raise ValueError("stack_adapters needs at least one adapter (id 0, the base weights, is implicit)")
    first = adapters[0]
    if config is not None:
        check_adapter(first, config)
    for i, ad in enumerate(adapters[1:], start=1):
        lines = shape_differences(ad, first)
        if (ad.alpha, ad.rslora) != (first.alpha, first.rslora):
            lines.append(f"alpha/rslora: expected {(first.alpha, first.rslora)}, got {(ad.alpha, ad.rslora)}")
        if lines:
            raise ValueError(
                f"adapter {i} (id {i + 1}) does not match adapter 0 (id 1); a bank needs one rank and shape:\n"
                + "\n".join(f"  {line}" for line in lines)
            )
    return LoraBank(adapters=_stack(*adapters))


@jax.jit
def _stack(*adapters: ExpertLora) -> ExpertLora:
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *adapters)


def init_bank(
    config: ExpertConfig | ModelConfig,
    num_adapters: int,
    rank: int,
    alpha: float | None = None,
    seed: int = 0,
    *,
    rslora: bool = False,
    targets: Sequence[str] = TARGETS,
    dtype=None,
) -> LoraBank:
    """A bank of `num_adapters` fresh adapters for training: A ~ N(0, 1/fan_in), B = 0.

    With B = 0 every adapter is exactly the base model until trained (unlike openpi's
    normal(0.01) init of both factors).

    Args:
      config: the expert (a `ModelConfig` means its VLM expert, the one that serves language).
      num_adapters: E; the bank serves ids 0 (base) .. E.
      rank: r, for every target.
      alpha: attention scaling numerator; default rank (scaling 1, as openpi's variants).
      seed: numpy seed (adapter i, target t drawn from PCG64([seed, i, t])).
      targets: subset of `TARGETS` that get LoRA.
      dtype: leaf dtype; default the `ModelConfig`'s dtype, else float32.

    Returns:
      A `LoraBank` with leaves [L, E, ...].
    """
    expert = _expert_config(config)
    if dtype is None:
        dtype = config.jnp_dtype if isinstance(config, ModelConfig) else jnp.float32
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or num_adapters < 1 or rank < 1:
        raise ValueError(
            f"init_bank: need num_adapters >= 1, rank >= 1 and targets from {TARGETS}; "
            f"got {num_adapters}, {rank}, {unknown or targets}"
        )
    pairs = {}
    for ti, target in enumerate(TARGETS):
        if target not in targets:
            pairs[target] = None
            continue
        a_shape, b_shape = target_shapes(expert_dims(expert), target, rank)
        fan_in = expert.num_heads * expert.head_dim if target == "out" else a_shape[-2]  # contracted size
        draws = [
            np.random.default_rng([seed, i, ti]).standard_normal((expert.depth,) + a_shape, dtype=np.float32)
            for i in range(num_adapters)
        ]
        a = np.stack(draws, axis=1) / np.float32(math.sqrt(fan_in))
        b = np.zeros((expert.depth, num_adapters) + b_shape, np.float32)
        # Cast on the host and transfer: no per-shape device programs.
        pairs[target] = LoraPair(a=jax.device_put(a.astype(dtype)), b=jax.device_put(b.astype(dtype)))
    return LoraBank(adapters=ExpertLora(**pairs, alpha=float(rank if alpha is None else alpha), rslora=rslora))
