import os

# The suite compiles a few hundred small programs; LLVM's optimisation passes dominate their cost, not the
# run time of tiny configs. Level 0 roughly halves compile time (measured: test_decode.py 95 s -> 60 s of
# CPU). Set before jax is imported; subprocesses that the tests start inherit it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import pytest  # noqa: E402

from oxygen_jax.models.pi05.config import model_config# noqa: E402
from oxygen_jax.models.pi05.params import init_params# noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module.

    Each XLA CPU executable keeps its own memory mappings; the whole suite compiles enough programs to
    pass the kernel's per-process limit (vm.max_map_count, 65,530), and a failed mapping inside the
    compiler is a segmentation fault. Modules share compiled programs within themselves, not across.
    """
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_params():
    """Random `tiny` parameters, bidirectional prompt (shared by all tests)."""
    return init_params(model_config("tiny"), 0)
