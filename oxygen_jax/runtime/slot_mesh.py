"""Serving on several local devices: the mesh, the model's placement, and the slot pool split over devices.

Axes (`oxygen_jax.axes`): Ns decode slots, J requests per admission call, Dr devices on the `robots` mesh axis,
n = Ns / Dr slots per device, Jd = min(J, n) admissions per device and call.

The serving mesh is 2-D, (`robots`, `model`):

    robots   batch rows (observations) and decode slots are split over it: a device prefills and denoises its
             robots' rows and owns n = Ns / Dr slots of the pool, whose K/V, carry and bookkeeping live only there
    model    tensor parallelism (size T, `serve --tensor-parallel T`): each weight split by attention heads or MLP
             columns (`models.partition.TP_RULES`), and the pool's K/V by KV heads when they divide; XLA's SPMD
             partitioner inserts the collectives

The decode burst runs in a `shard_map` that is manual over `robots` only (`per_device`): each device advances
its own slots with no cross-device traffic, decides alone whether any of its slots is active (a device whose
slots are idle skips the step), and the pool cannot be regathered by sharding propagation inside the scan.
Sharding annotations alone (GSPMD over the whole burst) would compute the same numbers but turn each step's
"any slot active" into an all-reduce and leave the pool's layout inside the loop to the partitioner. With
tensor parallelism (T > 1) the slot programs do run that way, the pool's layout pinned (`manual`, `pin`): a
per-device branch around a `model`-axis collective would leave its partner devices waiting.

Admission picks free slots as on one device (lowest index first, a global choice over Ns flags), then
`route` hands each device the requests that landed in its slots (at most Jd, a static shape): the device
gathers those prefix rows, runs their request prompts and samples their first tokens; no other device
copies them.

    Ns = 8, Dr = 2 (n = 4), J = 3, requests land in slots [1, 5, 2]:
    device 0 gets requests [0, 2, -] at local slots [1, 2, 4 = dropped]; device 1 gets [1, -, -] at [1, 4, 4].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from oxygen_jax.models.decoder import PrefixRows
from oxygen_jax.models.partition import param_specs

ROBOTS = "robots"
MODEL = "model"


def serving_mesh(devices: Sequence | None = None, tensor_parallel: int = 1) -> Mesh:
    """The (`robots`, `model`) mesh over `devices` (default: every local device): Dr = len / T rows of T devices.

    One-line ValueError when `tensor_parallel` does not divide the number of devices."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel < 1 or len(devices) % tensor_parallel:
        raise ValueError(f"--tensor-parallel {tensor_parallel} must be >= 1 and divide the {len(devices)} devices")
    return Mesh(np.array(devices).reshape(len(devices) // tensor_parallel, tensor_parallel), (ROBOTS, MODEL))


def robots_size(mesh: Mesh | None) -> int:
    """Dr, the devices the slots and batch rows are split over (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape[ROBOTS]


def model_size(mesh: Mesh | None) -> int:
    """T, the tensor-parallel degree (1 without a mesh or a `model` axis)."""
    return 1 if mesh is None else dict(mesh.shape).get(MODEL, 1)


def check_slots(num_slots: int, mesh: Mesh | None) -> None:
    """One-line ValueError unless the pool splits evenly over the mesh's `robots` axis (static shapes)."""
    if num_slots % robots_size(mesh):
        raise ValueError(f"num_slots = {num_slots} must be a multiple of the {robots_size(mesh)} devices on the "
                         f"'{ROBOTS}' mesh axis (every device owns the same number of slots): use "
                         f"{-(-num_slots // robots_size(mesh)) * robots_size(mesh)} slots")


def place_model(tree, mesh: Mesh):
    """`tree` (a `MultiHead`, a decoder, any weights) on `mesh`: split over `model` by `models.partition` when T > 1,
    replicated over `robots`."""
    specs = param_specs(tree, MODEL, model_size(mesh)) if MODEL in mesh.axis_names else \
        jax.tree.map(lambda _: PartitionSpec(), tree)
    return jax.device_put(tree, shardings(mesh, specs))


def kv_spec(mesh: Mesh, num_kv_heads: int) -> PartitionSpec:
    """The spec of pool K/V [L, Ns, C, K, H]: slots over `robots`, KV heads over `model` when they divide."""
    t = model_size(mesh)
    return PartitionSpec(None, ROBOTS, None, MODEL if t > 1 and num_kv_heads % t == 0 else None, None)


def shardings(mesh: Mesh, specs):
    """NamedShardings of a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def manual(mesh: Mesh) -> bool:
    """Whether the slot programs run per device (`per_device`): on a mesh without tensor parallelism. With T > 1
    they run under the SPMD partitioner with the pool's layout pinned: a per-device branch (a device skipping a
    step its slots do not need) around a `model`-axis collective would leave its partners waiting."""
    return model_size(mesh) == 1


def per_device(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """`fn` run by every device of the `robots` axis on its own shards (`jax.shard_map`, manual over `robots`
    only: a `model` axis in the specs is dropped here and stays with the SPMD partitioner inside)."""
    manual = functools.partial(jax.tree.map, _robots_only, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.shard_map(fn, mesh=mesh, in_specs=manual(in_specs), out_specs=manual(out_specs), axis_names={ROBOTS},
                         check_vma=False)


def _robots_only(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(*(a if a == ROBOTS else None for a in spec))


def route(slot: jax.Array, num_slots: int, devices: int) -> tuple[jax.Array, jax.Array]:
    """Which requests each device admits: (index int32 [Dr * Jd] into the J requests, local slot int32 [Dr * Jd]
    in [0, n], n = dropped), device d's entries at [d * Jd, (d + 1) * Jd), in request order.

    Args:
      slot: int32 [J] the global slot each request got (>= Ns: not admitted).
    """
    n = num_slots // devices
    per = min(slot.shape[0], n)
    owner = jnp.where(slot < num_slots, slot // n, devices)  # [J]
    mine = owner[None, :] == jnp.arange(devices)[:, None]  # [Dr, J]
    index = jnp.argsort(~mine, axis=1, stable=True)[:, :per].astype(jnp.int32)  # its requests first, in order
    taken = jnp.take_along_axis(mine, index, axis=1)
    local = jnp.where(taken, slot[index] - jnp.arange(devices)[:, None] * n, n)
    return index.reshape(-1), local.reshape(-1).astype(jnp.int32)


# --- the slot pool on the mesh (`runtime.decode.DecodePool`, read by its fields) ---------------------------


def pool_specs(pool):
    """A `decode.DecodePool`'s layout on its mesh, the pool with a PartitionSpec per leaf: every leaf split on its
    slot axis over `robots` (axis 1 of K/V and carry leaves [layers, Ns, ...], axis 0 of the rest), K/V also by KV
    heads over `model` when they divide (`kv_spec`)."""
    lead, kv = PartitionSpec(ROBOTS), kv_spec(pool.mesh, pool.k.shape[3])
    carry = None if pool.carry is None else jax.tree.map(lambda _: PartitionSpec(None, ROBOTS), pool.carry)
    return dataclasses.replace(jax.tree.map(lambda _: lead, pool), k=kv, v=kv, carry=carry)


def pin(pool):
    """The pool constrained to its mesh layout (`pool_specs`) inside a jitted program."""
    return jax.lax.with_sharding_constraint(pool, shardings(pool.mesh, pool_specs(pool)))


def on_slot_devices(fn: Callable, pool, *shared):
    """`fn(pool, *shared) -> (pool, out [Ns, ...])` on the pool's slots: a plain call without a mesh; per device
    on its own slots on a mesh without tensor parallelism (`per_device`; `shared`, e.g. the decoder and its bank,
    replicated over `robots`); under the SPMD partitioner with the pool's layout pinned otherwise (`manual`)."""
    if pool.mesh is None:
        return fn(pool, *shared)
    if not manual(pool.mesh):
        pool, out = fn(pin(pool), *shared)
        return pin(pool), out
    specs, replicated = pool_specs(pool), (PartitionSpec(),) * len(shared)
    return per_device(fn, pool.mesh, (specs, *replicated), (specs, PartitionSpec(ROBOTS)))(pool, *shared)


def admit_per_device(write: Callable, lm, pool, prefix, req, slot: jax.Array, bank):
    """Admission's slot filling per device: `write(pool, view, requests, slot, lm, bank) -> (pool, first [Ns])`
    (`decode._write`) runs on every device for the requests that landed in its own slots (`route`), from their
    prefix rows (`lm.rows`, gathered for that device only); a device with none skips it.

    Args:
      slot: int32 [J] the global slot of each request of `req` (>= Ns: not admitted).
    Returns:
      (pool, first token int32 [Ns], -1 where no request was admitted).
    """
    index, local = route(slot, pool.num_slots, robots_size(pool.mesh))
    routed = jax.tree.map(lambda x: x[index], req)
    view = lm.rows(prefix, routed.row)
    rows, lead = PartitionSpec(ROBOTS), PartitionSpec(None, ROBOTS)
    carry = None if view.carry is None else jax.tree.map(lambda _: lead, view.carry)

    def local_write(pool, view, routed, local, lm, bank):
        idle = (pool, jnp.full((pool.num_slots,), -1, jnp.int32))
        return jax.lax.cond(jnp.any(local < pool.num_slots), lambda: write(pool, view, routed, local, lm, bank),
                            lambda: idle)

    specs = (pool_specs(pool), PrefixRows(lead, lead, rows, rows, rows, carry), rows, rows, PartitionSpec(),
             PartitionSpec())
    return per_device(local_write, pool.mesh, specs, (pool_specs(pool), rows))(pool, view, routed, local, lm, bank)
