"""Multi-process data parallelism shared by the trainers: start-up, the global mesh, process-local rows,
host copies of global arrays, FSDP shardings and a fixed-order gradient reduction.

One process per host (or per GPU), started by hand (`--coordinator HOST:PORT --num-processes N
--process-id I`) or by a launcher that `jax.distributed.initialize()` detects by itself (SLURM, Open MPI,
Kubernetes' indexed jobs). After `initialize`, `jax.devices()` lists every device of every process and
one `jax.sharding.Mesh` spans them all; each process holds only the shards of its own devices.

Rows: a batch of B rows is split over the mesh's "data" axis; `process_rows` names the contiguous
global rows [start, stop) whose shards live on this process, and `global_batch` assembles the global
array from each process's own rows (`jax.make_array_from_process_local_data`), so a process decodes
and copies only B / N rows per step and nothing checks the others' data.

Start-up and failure are bounded in time, each ending in one line (exit status 2) instead of a C++ abort:
a process other than 0 first connects to the coordinator's port by TCP ("cannot reach HOST:PORT within
N s"); then every process joins within `init_timeout_s` or stops naming what did not happen; once running,
a process silent for `heartbeat_timeout_s` (default 10 s) counts as dead and the coordination service ends
every other process (measured here: within seconds). `agree` refuses a run whose processes were given
different data (their digests differ) before the first step.

Axes (`oxygen_jax.axes`): B batch rows, N devices on the mesh's "data" axis.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"  # the mesh axis rows are split over
# Environment variables by which a launcher that jax.distributed.initialize() detects announces several tasks.
_LAUNCHER_TASKS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
# Or the three values spelled out (e.g. by a Kubernetes indexed job's pod template).
_ENV_FLAGS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How this process joins a multi-process run (all None and no launcher: one process, nothing to join).

    Attributes:
      coordinator: "HOST:PORT" of process 0's coordination service (None: from the launcher's environment).
      num_processes, process_id: N and this process's index in 0 .. N-1 (None: from the launcher).
      heartbeat_timeout_s: a process silent this long counts as dead and every other process exits non-zero
        (the default ends the survivors well within 30 s of a peer's death).
      init_timeout_s: how long start-up waits for the coordinator to be reachable and every process to join.
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = 10
    init_timeout_s: int = 300

    def __post_init__(self):
        given = [x is not None for x in (self.coordinator, self.num_processes, self.process_id)]
        if any(given) and not all(given):
            raise ValueError("DistributedConfig: give coordinator, num_processes and process_id together "
                             "(--coordinator HOST:PORT --num-processes N --process-id I), or none under a launcher")
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"DistributedConfig.coordinator must be HOST:PORT (e.g. 10.0.0.1:12345), "
                                 f"got {self.coordinator!r}")
        if self.num_processes is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"DistributedConfig.process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.heartbeat_timeout_s < 1 or self.init_timeout_s < 1:
            raise ValueError("DistributedConfig: heartbeat_timeout_s and init_timeout_s must be >= 1 second")

    @property
    def requested(self) -> bool:
        """True when flags or `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID` name a run, or a
        launcher's environment (SLURM, Open MPI) announces more than one task."""
        return (self.coordinator is not None or all(os.environ.get(k) for k in _ENV_FLAGS)
                or any(int(os.environ.get(k, "1") or 1) > 1 for k in _LAUNCHER_TASKS))


class StartError(RuntimeError):
    """Start-up did not complete: the coordinator cannot be reached (one line naming it and the wait)."""


def initialize(config: DistributedConfig) -> bool:
    """Joins the multi-process run `config` describes (before any other JAX call); False: one process.

    CPU collectives go through gloo (so CPU runs, e.g. the tests, work across processes); GPUs use NCCL.
    Raises `StartError` when a process other than 0 cannot reach the coordinator by TCP within
    `init_timeout_s`; if the processes then do not all join in the time left, this process prints one line
    and exits with status 2 (JAX itself would abort with a C++ stack dump).
    """
    if not config.requested:
        return False
    coordinator, n, i = config.coordinator, config.num_processes, config.process_id
    if coordinator is None and all(os.environ.get(k) for k in _ENV_FLAGS):
        coordinator, n, i = (os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                             int(os.environ["JAX_PROCESS_ID"]))
    deadline = time.monotonic() + config.init_timeout_s
    if coordinator is not None and i not in (None, 0):
        wait_for_coordinator(coordinator, config.init_timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    left = max(1.0, deadline - time.monotonic())
    watchdog = threading.Timer(left, _give_up, args=(coordinator, config.init_timeout_s, i))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(  # JAX's own limit lies beyond the watchdog's, which reports in one line first
            coordinator, n, i, initialization_timeout=int(left) + 30,
            heartbeat_timeout_seconds=config.heartbeat_timeout_s,
            shutdown_timeout_seconds=max(config.heartbeat_timeout_s, 5))
    finally:
        watchdog.cancel()
    return True


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Returns once a TCP connection to `address` ("HOST:PORT") succeeds; `StartError` after `timeout_s`."""
    host, _, port = address.rpartition(":")
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, max(timeout_s, 0.1))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise StartError(f"cannot reach the coordinator {address} within {timeout_s:g} s ({last.strerror or last}); "
                             "start process 0 first, check --coordinator (process 0's host and a free port) and the "
                             "firewall, or raise --init-timeout")
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


def _give_up(coordinator, timeout_s: float, process_id) -> None:
    """The watchdog: every process has not joined in time (JAX would abort with a C++ stack dump instead)."""
    who = "the coordinator" if process_id not in (None, 0) else "every other process"
    print(f"error: not every process joined the run at {coordinator or 'the launcher'} within {timeout_s:g} s "
          f"(this is process {process_id}; waited for {who}); start all --num-processes processes with the same "
          "--coordinator, or raise --init-timeout", file=sys.stderr, flush=True)
    os._exit(2)


def is_primary() -> bool:
    """True on process 0: the one process that writes files, logs and exported weights."""
    return jax.process_index() == 0


def agree(what: str, digest: str) -> None:
    """Refuses (one-line ValueError) unless every process passes the same `digest` of `what`, e.g. of the
    data it was given; a no-op with one process. Collective: every process must call it."""
    if jax.process_count() == 1:
        return
    mine = np.frombuffer(hashlib.sha256(digest.encode()).digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 32]
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise ValueError(f"{what} differs between processes: process {differ[0]} has another than process 0 "
                         f"({len(differ)} of {every.shape[0]} differ); give every process the same")


def barrier(name: str) -> None:
    """Waits until every process arrives here (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# -------------------------------------------------------------------------------------------------
# Rows: process-local data → global arrays
# -------------------------------------------------------------------------------------------------


def process_rows(mesh: Mesh, batch: int) -> tuple[int, int]:
    """[start, stop): the global rows of a [B, ...] array split over "data" whose shards this process holds.

    E.g. B = 8 on 4 devices, 2 per process: process 0 holds rows [0, 4), process 1 rows [4, 8).
    """
    if batch % mesh.shape[DATA]:
        raise ValueError(f"batch {batch} is not a multiple of the mesh's {mesh.shape[DATA]} data-parallel devices")
    index_map = NamedSharding(mesh, P(DATA)).addressable_devices_indices_map((batch,))
    starts = sorted({(s[0].start or 0, s[0].stop if s[0].stop is not None else batch) for s in index_map.values()})
    for (_, stop), (start, _) in zip(starts, starts[1:]):
        if stop != start:
            raise ValueError("this process's devices hold non-contiguous rows of the mesh; build the mesh from "
                             "jax.devices() in order (training.memory.model.make_mesh)")
    return starts[0][0], starts[-1][1]


def global_batch(local_tree, mesh: Mesh, batch: int):
    """The global [B, ...] arrays, rows over "data", assembled from this process's rows `process_rows(mesh, B)`."""
    sharding = NamedSharding(mesh, P(DATA))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        sharding, np.asarray(x), (batch, *np.shape(x)[1:])), local_tree)


def host(tree):
    """Numpy copies of the full values of a tree of (global) arrays, on every process.

    Replicated arrays are read from a local shard; sharded ones (FSDP) are gathered from all processes.
    """
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(jax.device_get(x))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def sum_over_processes(values: Mapping[str, float]) -> dict[str, float]:
    """Each value summed over all processes (e.g. exact-match hits of each process's share of an evaluation)."""
    keys = sorted(values)
    if jax.process_count() == 1:
        return {k: float(values[k]) for k in keys}
    mine = np.asarray([float(values[k]) for k in keys], np.float64)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, keys]
    return {k: float(v) for k, v in zip(keys, every.sum(axis=0))}


# -------------------------------------------------------------------------------------------------
# Shardings of the state: replicated, or FSDP above a size
# -------------------------------------------------------------------------------------------------


def fsdp_spec(shape: tuple[int, ...], devices: int, min_size: int | None) -> P:
    """The PartitionSpec of one leaf: replicated, or (FSDP) its largest axis divisible by `devices` split over
    "data" when the leaf has at least `min_size` elements (None: never; scalars and indivisible leaves stay
    replicated). E.g. [4, 128, 512] on 2 devices with min_size 1024: P(None, None, "data")."""
    size = int(np.prod(shape, dtype=np.int64))
    if min_size is None or size < min_size or devices == 1:
        return P()
    axes = [a for a in range(len(shape)) if shape[a] % devices == 0]
    if not axes:
        return P()
    axis = max(axes, key=lambda a: (shape[a], -a))
    return P(*[DATA if a == axis else None for a in range(len(shape))])


def state_shardings(tree, mesh: Mesh, min_size: int | None = None):
    """A tree of `NamedSharding`s for `tree` (arrays or ShapeDtypeStructs): `fsdp_spec` per leaf."""
    n = mesh.shape[DATA]
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(np.shape(x)), n, min_size)), tree)


def put(tree, shardings):
    """`tree` placed with `shardings` (a matching tree); host values must be equal on every process."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)


# -------------------------------------------------------------------------------------------------
# Fixed-order reduction (inside shard_map over "data")
# -------------------------------------------------------------------------------------------------


def fixed_order_sum(x: jax.Array, axis_name: str = DATA) -> jax.Array:
    """The sum of `x` over the devices of `axis_name`, device 0 first: all-gather, then one add per device.

    An all-reduce may add the devices' values in any order (gloo and NCCL choose by topology), so the last
    bits depend on the process layout; this sum depends only on the number of devices: 4 processes × 1
    device, 2 × 2 and 1 × 4 give the same bits. Costs an all-gather (N × the size) instead of an all-reduce.
    """
    gathered = jax.lax.all_gather(x, axis_name, to="invarying")  # the same value on every device
    return functools.reduce(jnp.add, [gathered[i] for i in range(gathered.shape[0])])


def as_varying(tree, axis_name: str = DATA):
    """`tree` typed as differing per device, so `jax.grad` of a per-device loss gives per-device gradients
    (differentiating a replicated input under shard_map already sums its gradient over the devices)."""
    return jax.tree.map(lambda x: jax.lax.pcast(x, axis_name, to="varying"), tree)
