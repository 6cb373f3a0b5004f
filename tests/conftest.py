import pytest

from oxygen_jax.config import model_config
from oxygen_jax.params import init_params


@pytest.fixture(scope="session")
def tiny_params():
    """Random `tiny` parameters, bidirectional prompt (shared by all tests)."""
    return init_params(model_config("tiny"), 0)
