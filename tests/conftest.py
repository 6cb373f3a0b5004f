import os

# The suite compiles a few hundred small programs; their compile time, not the run time of tiny configs,
# dominates. Two XLA CPU options cut it without touching what is computed: LLVM optimisation level 0
# (test_decode.py 95 s -> 60 s of CPU) and the classic loop emitters instead of the MLIR fusion emitters
# (about 2x again: a four-settings test 8.6 s -> 4.2 s). A third keeps each program's LLVM module in one piece
# (XLA splits it to compile the parts on parallel threads: faster on idle cores, more CPU in all, and the
# suite's cores are never idle): test_decode + test_qwen35_runtime 29.4 s -> 24.4 s of compile CPU, 60 s -> 50 s
# in all (2026-12-07, load 4-6).
# Set before jax is imported; subprocesses that the tests start inherit them.
# OXYGEN_JAX_TEST_XLA_DEFAULTS=1 runs the suite under XLA's own defaults.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                 "--xla_cpu_parallel_codegen_split_count=1")
if os.environ.get("OXYGEN_JAX_TEST_XLA_DEFAULTS") != "1":
    _flags = os.environ.get("XLA_FLAGS", "")
    for _flag in _FAST_COMPILE:
        if _flag.split("=")[0] not in _flags:
            _flags = f"{_flags} {_flag}"
    os.environ["XLA_FLAGS"] = _flags.strip()

# Test modules compile many of the same programs (a tiny engine step, the pool's burst) in separate worker
# processes and after each module's `jax.clear_caches()`. One persistent compilation cache per test run,
# shared by the xdist workers and the command-line subprocesses the tests start, compiles each program once
# (a fresh directory per run: nothing carries over between runs). OXYGEN_JAX_TEST_COMPILE_CACHE=0 turns it off.
_CACHE = None


def _use_cache(run_id: str) -> str:
    import tempfile

    cache = os.path.join(tempfile.gettempdir(), f"oxygen_jax_test_xla_{run_id}")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["OXYGEN_JAX_CACHE_DIR"] = cache
    return cache


if os.environ.get("OXYGEN_JAX_TEST_COMPILE_CACHE") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = _use_cache(os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}")

import pytest  # noqa: E402


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than cores (at most 4). Workers also wait (on the servers and command-line
    subprocesses the tests start), and a third worker fills that time: on 2 cores the suite took 321 s with
    three workers against 357 s with two (fresh clones of `85ac70f`, 2026-12-06)."""
    return min(4, (os.cpu_count() or 1) + 1)


# The files that take longest, longest first (summed test times of the whole suite at e252fa7, 2026-12-07).
# pytest.ini turns off xdist's own order (files with the most tests first), which started these files, most
# of them with few tests, last: a worker still compiling one of them while the others idle bounded the run.
# Files not named keep xdist's order after them; a name that no longer exists is ignored.
_SLOWEST_FIRST = (
    "test_speculative.py", "test_pi_checkpoints.py", "test_qwen35_lora.py", "test_device_check.py", "test_parity.py",
    "test_eval_bench.py", "test_memory_lora.py", "test_multihost.py", "test_adapters.py", "test_serve_native.py",
    "test_qwen35_runtime.py", "test_decode.py", "test_qwen35.py", "test_starvla_native.py",
    "test_engine_multihead.py", "test_xr0_native.py", "test_memory_eval.py", "test_rtc_runtime.py",
    "test_isolation.py", "test_serve.py", "test_decoder_pool.py", "test_slot_mesh.py", "test_lerobot_memory.py",
    "test_leaf_stream.py", "test_fanout.py", "test_serve_rtc.py", "test_pi0_fast.py", "test_openpi_widths.py",
    "test_stop_ids.py", "test_mot.py", "test_roofline.py", "test_pi05_as_model.py", "test_training.py",
)


def pytest_collection_modifyitems(config, items):
    """Whole files, the slowest first (`_SLOWEST_FIRST`), then the rest by number of tests (xdist's order)."""
    import collections

    rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    count = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path], str(item.path)))


def pytest_configure(config):
    """The controller of an xdist run names the run id itself, so it knows the workers' cache and can remove it."""
    global _CACHE
    if _CACHE is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "testrunuid", "") is None:
        import uuid

        config.option.testrunuid = uuid.uuid4().hex
        _CACHE = _use_cache(config.option.testrunuid)


def pytest_unconfigure(config):
    if _CACHE is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        import shutil

        shutil.rmtree(_CACHE, ignore_errors=True)

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
