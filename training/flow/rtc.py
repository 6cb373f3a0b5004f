"""Training-time real-time chunking for π0.5 (Black, Ren, Equi, Levine, arXiv 2512.05964).

Per example a delay d is drawn in [0, max_delay]; the first d actions of the chunk are the committed prefix:
they enter the action expert clean (x = the ground-truth action) at the clean flow time t = 0, the others at
the example's sampled time t (per-token adaRMS conditioning, `models.pi05.model.velocity` with t [B, Ha]),
and the loss is the flow-matching loss over the postfix only. Inference then overwrites the prefix with the
committed actions at every step (`runtime.rtc`, mode "trained"): no extra compute.

    loss = train_rtc.compute_loss_rng(params, rng, observation, actions, RtcTrainConfig(max_delay=4))
    state, metrics = train_rtc.train_step(state, rng, observation, actions, cfg=RtcTrainConfig(max_delay=4))

Axes (`oxygen_jax.axes`): B examples, Ha actions per chunk, Ad action dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from oxygen_jax.models.pi05 import model
from oxygen_jax.models.pi05.observation import Observation
from oxygen_jax.models.pi05.params import Params
from training.flow.train_step import TrainState, step_metrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class RtcTrainConfig:
    """How training draws the committed prefix length d."""

    max_delay: int = 4  # d is drawn in [0, max_delay]; inference must keep d <= max_delay
    distribution: Literal["uniform", "exp"] = "uniform"  # "exp": P(d) proportional to exp(-decay * d)
    decay: float = 1.0  # rate of the "exp" distribution

    def __post_init__(self):
        if self.max_delay < 0:
            raise ValueError(f"RtcTrainConfig.max_delay must be >= 0, got {self.max_delay}")
        if self.distribution not in ("uniform", "exp"):
            raise ValueError(f"RtcTrainConfig.distribution must be 'uniform' or 'exp', got {self.distribution!r}")
        if not self.decay > 0:
            raise ValueError(f"RtcTrainConfig.decay must be > 0, got {self.decay}")


def sample_delay(rng: jax.Array, batch: int, cfg: RtcTrainConfig) -> jax.Array:
    """int32 [B] delays in [0, max_delay]."""
    d = jnp.arange(cfg.max_delay + 1, dtype=jnp.float32)
    logits = jnp.zeros_like(d) if cfg.distribution == "uniform" else -cfg.decay * d
    return jax.random.categorical(rng, logits, shape=(batch,)).astype(jnp.int32)


def token_time(time: jax.Array, delay: jax.Array, horizon: int) -> jax.Array:
    """Per-token flow time float32 [B, Ha]: 0 (clean) on the first d actions, the row's time after them."""
    prefix = jnp.arange(horizon)[None] < delay[:, None]
    return jnp.where(prefix, 0.0, time[:, None]).astype(jnp.float32)


@jax.jit
def compute_loss(params: Params, observation: Observation, actions: jax.Array, noise: jax.Array, time: jax.Array,
                 delay: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Flow-matching loss with a committed prefix of d clean actions per row.

    x_t = t_i * noise + (1 - t_i) * actions per token (t_i = 0 on the prefix, so x = actions there);
    target u = noise - actions.

    Args:
      actions, noise: [B, Ha, Ad]; time: [B] in (0, 1]; delay: int32 [B] in [0, Ha].
    Returns:
      (per-step loss [B, Ha] = mean over Ad of (v - u)^2, bool [B, Ha] postfix mask the loss counts).
    """
    t_tok = token_time(time, delay, actions.shape[1])
    t = t_tok[:, :, None]
    x_t = t * noise + (1 - t) * actions
    v = model.velocity(params, model.prefill(params, observation), x_t, t_tok)
    return jnp.mean(jnp.square(v - (noise - actions)), axis=-1), t_tok > 0


def masked_mean(loss: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `loss` [B, Ha] over the postfix entries (`mask`), 0 if there are none."""
    m = mask.astype(loss.dtype)
    return jnp.sum(loss * m) / jnp.maximum(jnp.sum(m), 1.0)


def compute_loss_rng(params: Params, rng: jax.Array, observation: Observation, actions: jax.Array,
                     cfg: RtcTrainConfig) -> jax.Array:
    """The postfix mean loss with noise and time drawn as openpi draws them and d from `cfg`."""
    if cfg.max_delay >= actions.shape[1]:
        raise ValueError(f"RtcTrainConfig.max_delay ({cfg.max_delay}) must be below the chunk length Ha = {actions.shape[1]}")
    rng, k_delay = jax.random.split(rng)
    noise, time = model.sample_noise_and_time(rng, actions.shape)
    delay = sample_delay(k_delay, actions.shape[0], cfg)
    return masked_mean(*compute_loss(params, observation, actions, noise, time, delay))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def train_step(state: TrainState, rng: jax.Array, observation: Observation, actions: jax.Array, *,
               cfg: RtcTrainConfig):
    """One optimisation step on the training-time-RTC loss (as `training.flow.train_step.train_step`). Donates `state`.

    Returns:
      (new state, {"loss": postfix mean loss, "grad_norm": global gradient norm, "finite": see `step_metrics`}).
    """
    loss, grads = jax.value_and_grad(lambda p: compute_loss_rng(p, rng, observation, actions, cfg))(state.params)
    updates, opt_state = state.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new = dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state)
    return new, step_metrics(loss, grads, (params, opt_state))
