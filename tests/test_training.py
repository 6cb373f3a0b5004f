"""The flow-matching train step: gradients flow everywhere the loss depends on, loss drops, and a step whose
loss or state is not finite says so (`finite`), so a loop can stop before saving it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_obs
from training.flow.train_step import OptimizerConfig, all_finite, init_train_state, make_optimizer, train_step


def _own_copy(params):
    """Fresh buffers: `train_step` donates the state, which must not delete the session's shared parameters."""
    return jax.tree.map(jnp.copy, params)


@pytest.fixture(scope="module")
def opt():
    """One optimizer object for the file: the step is compiled once (the optimizer is a static field)."""
    return make_optimizer(OptimizerConfig(peak_lr=3e-3, final_lr=3e-3, warmup_steps=1, decay_steps=100))


def test_repeated_steps_on_one_batch_reduce_the_flow_matching_loss(tiny_params, opt):
    obs = make_obs(tiny_params.config, batch=2)
    actions = jax.random.uniform(jax.random.key(0), (2, 4, 32), minval=-1, maxval=1)
    state = init_train_state(_own_copy(tiny_params), opt)
    fixed = jax.random.key(2)  # the same noise/time draw every step, so losses are comparable
    losses = []
    for _ in range(15):
        state, metrics = train_step(state, fixed, obs, actions)
        losses.append(float(metrics["loss"]))
        assert np.isfinite(metrics["grad_norm"]) and float(metrics["grad_norm"]) > 0 and bool(metrics["finite"])
    assert int(state.step) == 15
    assert losses[-1] < 0.7 * losses[0], losses


def test_a_step_on_a_nan_batch_reports_itself_not_finite(tiny_params, opt):
    obs = make_obs(tiny_params.config, batch=2)
    actions = jax.random.uniform(jax.random.key(0), (2, 4, 32), minval=-1, maxval=1)
    state = init_train_state(_own_copy(tiny_params), opt)
    state, metrics = train_step(state, jax.random.key(2), obs, actions.at[0, 0, 0].set(jnp.nan))
    assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["loss"]))
    assert not bool(all_finite(state.params))  # what a loop would have saved


def test_all_finite_reads_every_float_leaf_and_ignores_integer_ones():
    tree = {"a": jnp.zeros(3), "b": {"c": jnp.ones((2, 2), jnp.bfloat16)}, "n": jnp.array([7], jnp.int32)}
    assert bool(all_finite(tree)) and bool(all_finite({"n": jnp.array(1)}))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        assert not bool(all_finite({**tree, "b": {"c": tree["b"]["c"].at[1, 0].set(bad)}})), bad
