"""π0.5's observation: `models.observation.Observation` (camera images, their masks, the tokenized prompt),
re-exported here with the check against a π0.5 `ModelConfig`.

Axes and fields: see `oxygen_jax/models/observation.py` (B batch, Nc present cameras, Px image side,
Tp prompt tokens). `oxygen_jax.robots.transforms` builds it from robot (client) dictionaries.
"""

from __future__ import annotations

from oxygen_jax.models.observation import Observation, trim_prompt_padding, validate
from oxygen_jax.models.pi05.config import ModelConfig

__all__ = ["Observation", "validate_observation", "trim_prompt_padding"]


def validate_observation(obs: Observation, config: ModelConfig, num_cameras: int | None = None) -> None:
    """Raises ValueError naming the first problem with `obs` for this π0.5 config (see `models.observation.validate`)."""
    validate(obs, image_size=config.siglip.image_size, vocab_size=config.vocab_size, num_cameras=num_cameras)
