"""The flow-matching train step: gradients flow everywhere the loss depends on, and loss drops."""

from __future__ import annotations

import jax
import numpy as np

from helpers import make_obs
from training.train_step import OptimizerConfig, init_train_state, make_optimizer, train_step


def test_repeated_steps_on_one_batch_reduce_the_flow_matching_loss(tiny_params):
    obs = make_obs(tiny_params.config, batch=2)
    actions = jax.random.uniform(jax.random.key(0), (2, 4, 32), minval=-1, maxval=1)
    opt = make_optimizer(OptimizerConfig(peak_lr=3e-3, final_lr=3e-3, warmup_steps=1, decay_steps=100))
    state = init_train_state(tiny_params, opt)
    fixed = jax.random.key(2)  # the same noise/time draw every step, so losses are comparable
    losses = []
    for _ in range(15):
        state, metrics = train_step(state, fixed, obs, actions)
        losses.append(float(metrics["loss"]))
        assert np.isfinite(metrics["grad_norm"]) and float(metrics["grad_norm"]) > 0
    assert int(state.step) == 15
    assert losses[-1] < 0.7 * losses[0], losses
