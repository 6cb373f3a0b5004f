"""Small builders shared by the tests (tiny inputs only)."""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from oxygen_jax.config import ModelConfig
from oxygen_jax.observation import Observation

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    env = os.environ.get("OXYGEN_SHARED_DIR")
    return (Path(env) if env else REPO.parent / "shared").resolve()


def openpi_fixture() -> Path:
    """The openpi tiny π0.5 fixture directory, or a visible skip when ../shared is absent."""
    path = shared_dir() / "fixtures" / "openpi_tiny_pi05"
    if not path.is_dir():
        pytest.skip(f"../shared fixtures not present: {path}")
    return path


def make_obs(
    cfg: ModelConfig, *, batch: int = 2, cameras: int = 2, prompt_len: int = 12, lengths=None, image_masks=None,
    seed: int = 0,
) -> Observation:
    """A random observation: BOS + random ids, 0-padded; all cameras valid unless `image_masks`."""
    rng = np.random.default_rng(seed)
    s = cfg.siglip.image_size
    lengths = lengths if lengths is not None else [prompt_len - 2 - (i % 3) for i in range(batch)]
    tokens = np.zeros((batch, prompt_len), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(3, cfg.vocab_size, n)
        tokens[b, 0] = 2
    masks = np.ones((batch, cameras), bool) if image_masks is None else np.asarray(image_masks, bool)
    return Observation(
        images=jnp.asarray(rng.uniform(-1, 1, (batch, cameras, s, s, 3)), jnp.float32),
        image_masks=jnp.asarray(masks),
        tokens=jnp.asarray(tokens),
        token_mask=jnp.asarray(tokens > 0),
    )
