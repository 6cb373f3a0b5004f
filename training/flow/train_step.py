"""A jitted flow-matching train step over the pure π0.5 functions, with optax.

    state = init_train_state(params, make_optimizer(OptimizerConfig()))
    state, metrics = train_step(state, jax.random.fold_in(run_key, step), observation, actions)

Defaults follow openpi's π0.5 fine-tuning recipe: AdamW (b1 0.9, b2 0.95, eps 1e-8, weight decay
1e-10) after global-norm clipping at 1.0, with a cosine schedule (linear warm-up to the peak, then
cosine decay). Noise and time are drawn per step the way openpi draws them
(`model.sample_noise_and_time`) from the key the caller passes for the step (openpi uses
`fold_in(run_key, step)`). Data parallel, on one process or several: `make_sharded_train_step`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oxygen_jax.models.pi05 import model
from oxygen_jax.models.pi05.observation import Observation
from oxygen_jax.models.pi05.params import Params
from training import distributed


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    peak_lr: float = 2.5e-5
    final_lr: float = 2.5e-6
    warmup_steps: int = 1_000
    decay_steps: int = 30_000
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 1e-10
    clip_norm: float = 1.0


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=cfg.peak_lr / (cfg.warmup_steps + 1), peak_value=cfg.peak_lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.decay_steps, end_value=cfg.final_lr,
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # int32 []
    params: Params
    opt_state: optax.OptState
    optimizer: optax.GradientTransformation = dataclasses.field(metadata=dict(static=True))


def all_finite(tree) -> jax.Array:
    """bool []: every float leaf of `tree` is free of NaN and ±inf (integer leaves count as finite)."""
    checks = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.stack(checks).all() if checks else jnp.array(True)


def step_metrics(loss: jax.Array, grads, new_state) -> dict:
    """{"loss", "grad_norm", "finite"} of one step; `finite` is False when the loss, the gradient norm or any float
    leaf of the updated state is NaN or ±inf: a loop stops there rather than save garbage."""
    grad_norm = optax.tree.norm(grads)
    return {"loss": loss, "grad_norm": grad_norm,
            "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(new_state)}


def init_train_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), optimizer=optimizer)


def _train_step(state: TrainState, rng: jax.Array, observation: Observation, actions: jax.Array):
    """One optimisation step on the mean flow-matching loss. Donates `state`.

    Args:
      rng: this step's key (noise and time are drawn from it).
      observation: a batch [B, ...]; actions: normalised, padded [B, Ha, A].
    Returns:
      (new state, {"loss": mean loss, "grad_norm": global gradient norm, "finite": `step_metrics`' check}).
    """
    def loss_fn(params):
        return jnp.mean(model.compute_loss_rng(params, rng, observation, actions))

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = state.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new = dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state)
    return new, step_metrics(loss, grads, (params, opt_state))


train_step = jax.jit(_train_step, donate_argnames=("state",))


def make_sharded_train_step(mesh: Mesh, state: TrainState, *, fsdp_min_size: int | None = None):
    """`train_step` over a data-parallel mesh (one process or several, `training.distributed`), and `state` placed.

    The batch (`observation`, `actions`: global [B, ...] arrays, e.g. `distributed.global_batch` of each process's
    rows) is split over the mesh's "data" axis and XLA all-reduces the gradients; parameters and optimizer
    state are replicated, or, with `fsdp_min_size`, leaves of at least that many elements are sharded (FSDP,
    `distributed.fsdp_spec`). Noise and time are drawn for the global batch (`jax_threefry_partitionable`), so
    the step computes what `train_step` computes on the whole batch, up to float32 summation order.

    Returns:
      (step(state, rng, observation, actions) -> (state, metrics), the state placed on the mesh). Donates `state`.
    """
    shardings = distributed.state_shardings(state, mesh, fsdp_min_size)
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(distributed.DATA))
    step = jax.jit(_train_step, donate_argnames=("state",), in_shardings=(shardings, rep, rows, rows),
                   out_shardings=(shardings, rep))
    return step, distributed.put(state, shardings)
