"""Compilation settings shared by the entry points: JAX's persistent cache, and stacks for compiling threads.

A frame program takes seconds (tiny) to tens of seconds (full size) to compile; with the cache a
second run of `python -m oxygen_jax.run` or a restarted server loads the compiled executables from
disk instead. The directory is `$OXYGEN_JAX_CACHE_DIR`, else `~/.cache/oxygen_jax/xla`.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import threading
from pathlib import Path

import jax

ENV_VAR = "OXYGEN_JAX_CACHE_DIR"


def default_dir() -> Path:
    """`$OXYGEN_JAX_CACHE_DIR`, else `~/.cache/oxygen_jax/xla` (a temp-dir path when there is no home directory)."""
    env = os.environ.get(ENV_VAR)
    try:
        return Path(env).expanduser() if env else Path.home() / ".cache" / "oxygen_jax" / "xla"
    except RuntimeError:  # "Could not determine home directory": HOME unset and no passwd entry
        return Path(tempfile.gettempdir()) / "oxygen_jax_xla"


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Caches every compiled program (however quick to compile) under `path`; returns the directory.

    Returns None, leaving the cache off, when the directory cannot be created or written (a read-only
    home, a path through a file, `~user` of no such user, a NUL in the name): the cache only saves
    time, so its absence must never stop a run.
    """
    try:
        cache = Path(path).expanduser() if path is not None else default_dir()
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=cache):  # writable? (mkdir succeeds on an existing read-only dir)
            pass
    except (OSError, RuntimeError, ValueError, TypeError):
        return None
    jax.config.update("jax_compilation_cache_dir", str(cache))
    # The defaults skip programs that compile in under a second: most of a tiny run's programs.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return cache


COMPILE_THREAD_STACK = 64 << 20


def thread_pool(max_workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads may compile XLA programs: each thread gets a 64 MiB stack.

    XLA's compiler recurses deeply on large programs; off the main thread the default 8 MiB pthread
    stack is what it gets, and overflowing it is a segmentation fault, not an exception. The
    threads are started here, while the larger stack size is in effect (it is virtual memory).
    """
    previous = threading.stack_size(COMPILE_THREAD_STACK)
    try:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix=name)
        barrier = threading.Barrier(max_workers + 1)
        for _ in range(max_workers):  # one blocked task per worker forces every thread to start now
            pool.submit(barrier.wait)
        barrier.wait()
    finally:
        threading.stack_size(previous)
    return pool
