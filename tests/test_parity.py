"""Parity with openpi's π0.5 and OxyGen's text decoding on the shared tiny fixture."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval import parity
from helpers import openpi_fixture
from oxygen_jax import checkpoint, model


@pytest.fixture(scope="module")
def rows():
    return parity.run_fixture(openpi_fixture())


def test_every_reference_quantity_matches_in_both_checkpoint_layouts(rows):
    failed = [f"{r.quantity} [{r.layout}] max abs {r.max_abs:.3g}" for r in rows if not r.ok]
    assert not failed, failed
    layouts = {r.layout for r in rows}
    assert layouts == {"released", "training/1"}
    names = {r.quantity for r in rows}
    for required in ("actions/num_steps_10", "prefix/kv_cache_k (valid rows)", "step1/velocity_t1",
                     "loss/loss_explicit", "maskaware/tokens", "oxygen_allcams/first_step_logits",
                     "oxygen_actions/num_steps_10 (causal prompt)"):
        assert required in names


def test_rng_driven_loss_reproduces_openpi_draws():
    fx = openpi_fixture()
    seed = json.loads((fx / "config.json").read_text())["seeds"]["loss_rng_seed"]
    ref = np.load(fx / "reference.npz")
    _, params = checkpoint.load_openpi_params(fx / "params")
    noise, time = model.sample_noise_and_time(jax.random.key(seed), ref["loss/actions"].shape)
    np.testing.assert_allclose(noise, ref["loss/noise"], atol=1e-6)
    np.testing.assert_allclose(time, ref["loss/time"], atol=1e-6)
    obs = parity._observation(ref)
    loss = model.compute_loss_rng(params, jax.random.key(seed), obs, jnp.asarray(ref["loss/actions"]))
    np.testing.assert_allclose(loss, ref["loss/loss"], atol=5e-4)


def test_dropping_the_masked_camera_of_a_fixture_row_reproduces_openpi_actions():
    fx = openpi_fixture()
    ref = np.load(fx / "reference.npz")
    _, params = checkpoint.load_openpi_params(fx / "params")
    obs = parity._observation(ref)
    row = 1  # its left wrist camera is masked in the fixture
    assert not ref["image_mask/left_wrist_0_rgb"][row]
    keep = [0, 2]
    dropped = type(obs)(obs.images[row:row + 1, keep], obs.image_masks[row:row + 1, keep],
                        obs.tokens[row:row + 1], obs.token_mask[row:row + 1])
    actions = model.sample_actions(params, dropped, jnp.asarray(ref["noise"][row:row + 1]), 10)
    np.testing.assert_allclose(actions[0], ref["actions/num_steps_10"][row], atol=2e-4, rtol=1e-4)


def test_manifest_of_full_size_pi05_maps_exactly():
    from helpers import shared_dir

    path = shared_dir() / "fixtures" / "pi05_param_manifest.json"
    if not path.is_file():
        pytest.skip(f"../shared fixtures not present: {path}")
    assert parity.main(["--manifest", str(path)]) == 0
