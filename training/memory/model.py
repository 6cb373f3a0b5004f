"""The trainable trees, the loss and the compiled train step: the teacher-forced request-prompt pass.

Axes (`oxygen_jax.axes`): B batch rows, T suffix tokens (request prompt ‖ answer ‖ EOS ‖ padding), P prefix
tokens, V vocabulary, D VLM width, L layers, E stored adapters (1 here: adapter id 1; id 0 = base weights).

Adapter mode differentiates a `lora.LoraBank` only (the prefix is computed before `jax.grad` and the base
parameters are a plain argument of the step); base mode differentiates `BaseTrainable` (embedding, VLM
expert, SigLIP). Data parallelism: `make_mesh` and `place` (rows over the mesh's "data" axis), one process
or several (`training.distributed`); the gradient all-reduced by XLA or summed in a fixed order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oxygen_jax.models import lora
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.pi05.params import Expert, Params
from oxygen_jax.models.vision.siglip import Siglip
from training import distributed
from training.memory.config import Mode, TrainConfig
from training.memory.data import MemoryBatch
from training.flow.train_step import step_metrics


# -------------------------------------------------------------------------------------------------
# The base
# -------------------------------------------------------------------------------------------------


def load_base(path, dtype: str | None = None, *, vision_heads: int | None = None):
    """(params laid out for the backend, one line saying what they are, its robot I/O `robots.io.RobotIO`) of a
    base π checkpoint: anything `ckpts.load.load_model` reads as π0.5 or π0 (ours, an openpi checkpoint such as
    pi05_libero with LoRA merged, a LeRobot policy folder; `vision_heads`: a LeRobot SigLIP that is not So400m).

    Args:
      dtype: "float32" or "bfloat16" (e.g. a bf16 base under a float32 adapter); None keeps ours in their
        stored dtype and reads openpi's in float32. Ours keep their stored prompt attention.
    """
    from oxygen_jax.ckpts.load import load_model
    from oxygen_jax.ckpts.own import stored_config

    stored = stored_config(path)  # None: not ours
    dtype = dtype or (stored.dtype if stored is not None else "float32")
    loaded = load_model(path, family="pi05", dtype=dtype, vision_heads=vision_heads,
                        prompt_attention=stored.prompt_attention if stored is not None else "bidirectional")
    return loaded.params, loaded.what, loaded.io


# -------------------------------------------------------------------------------------------------
# Trainable trees and state
# -------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BaseTrainable:
    """The leaves base pre-training optimises: token embedding [V, D], the VLM expert, SigLIP."""

    embedding: jax.Array
    vlm: Expert
    siglip: Siglip


def base_trainable(params: Params) -> BaseTrainable:
    return BaseTrainable(embedding=params.embedding, vlm=params.vlm, siglip=params.siglip)


def with_base_trainable(params: Params, trainable: BaseTrainable) -> Params:
    """`params` with the embedding, VLM expert and SigLIP replaced (action expert and projections kept)."""
    return params.replace(embedding=trainable.embedding, vlm=trainable.vlm, siglip=trainable.siglip)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """step int32 []; trainable: a `lora.LoraBank` (adapter mode) or `BaseTrainable`; opt_state: optax state."""

    step: jax.Array
    trainable: lora.LoraBank | BaseTrainable
    opt_state: optax.OptState


def init_state(config: TrainConfig, params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0: a fresh float32 bank (B = 0, adapter id 1) or the base's own trainable leaves."""
    if config.mode == "adapter":
        trainable = pi05_lora.init_bank(params.config, 1, config.rank, config.alpha, config.seed, targets=config.targets,
                                   dtype=jnp.float32)
    else:
        trainable = jax.tree.map(jnp.array, base_trainable(params))  # own buffers: the state is donated
    return TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable, opt_state=optimizer.init(trainable))


# -------------------------------------------------------------------------------------------------
# Loss: the teacher-forced request-prompt pass
# -------------------------------------------------------------------------------------------------


def suffix_logits(params: Params, prefix, tokens: jax.Array, bank: lora.LoraBank | None = None,
                  adapter: jax.Array | None = None) -> jax.Array:
    """Teacher-forced logits of suffix tokens written after their own prefix rows: float32 [B, T, V].

    Exactly the slot pool's admission computation at each suffix position: `LanguageDecoder.suffix_forward`, then per
    position the final RMSNorm of [B, 1, D] and the tied head in vocabulary-major form [V, D]·[D, B], so
    entry [b, j] is, bit for bit, what admission samples from when row b's request prompt is
    `tokens[b, :j + 1]` and the admission batch has these B rows (tested). The per-position loop is what
    makes it exact: normalising [B, T, D] at once, or one [V, D]·[D, B·T] product, lets XLA vectorise the
    sums differently and changes last bits.

    Args:
      prefix: `Prefix` with B rows (row b continues sequence b).
      tokens: int32 [B, T]; bank, adapter: optional LoRA bank and int32 [B] adapter ids.
    """
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    _, _, h = model.language_model(params).suffix_forward(prefix, rows, tokens, bank, adapter)

    def position(h_j):  # [B, D] -> [V, B], as admission computes its seed logits
        normed = model.final_norm(params, h_j[:, None, :])
        return model.lm_logits_vocab_major(params, normed[:, 0])

    return jax.lax.map(position, jnp.swapaxes(h, 0, 1)).transpose(2, 0, 1)  # [T, V, B] -> [B, T, V]


def answer_sums(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(summed cross-entropy, answer tokens counted, teacher-forced argmax hits) over the answer tokens
    (targets `tokens[:, 1:]` where `loss_mask[:, 1:]`): sums, so shards of a batch add up to the whole.

    Args:
      logits: float32 [B, T, V] (`suffix_logits`); tokens int32 [B, T]; loss_mask bool [B, T].
    """
    lg, targets = logits[:, :-1], tokens[:, 1:]
    w = loss_mask[:, 1:].astype(jnp.float32)
    logp = jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    correct = jnp.sum((jnp.argmax(lg, axis=-1) == targets) * w)
    return jnp.sum(nll * w), jnp.sum(w), correct


def answer_loss(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, dict]:
    """Mean cross-entropy of the answer tokens (`answer_sums` divided by the tokens counted).

    Returns:
      (loss [], {"tokens": answer tokens counted, "correct": teacher-forced argmax hits}).
    """
    total, n, correct = answer_sums(logits, tokens, loss_mask)
    return total / jnp.maximum(n, 1.0), {"tokens": n, "correct": correct}


def _batch_logits(mode: Mode, trainable, params: Params, batch: MemoryBatch, prefix=None) -> jax.Array:
    if mode == "adapter":
        ids = jnp.ones((batch.suffix_tokens.shape[0],), jnp.int32)
        return suffix_logits(params, prefix, batch.suffix_tokens, trainable, ids)
    params = with_base_trainable(params, trainable)
    return suffix_logits(params, model.prefill(params, batch.observation), batch.suffix_tokens)


def batch_loss(mode: Mode, trainable, params: Params, batch: MemoryBatch, prefix=None):
    """(loss, stats) of one batch; `prefix` (adapter mode) is the base model's cache of `batch.observation`."""
    return answer_loss(_batch_logits(mode, trainable, params, batch, prefix), batch.suffix_tokens, batch.loss_mask)


def _train_step(mode: Mode, optimizer, state: TrainState, params: Params, batch: MemoryBatch):
    prefix = None
    if mode == "adapter":
        # Outside jax.grad: the base model's prefix is data for the adapter, never differentiated.
        prefix = jax.lax.stop_gradient(model.prefill(params, batch.observation))
    grad_fn = jax.value_and_grad(lambda t: batch_loss(mode, t, params, batch, prefix), has_aux=True)
    (loss, stats), grads = grad_fn(state.trainable)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
    trainable = optax.apply_updates(state.trainable, updates)
    metrics = {**step_metrics(loss, grads, (trainable, opt_state)), **stats}
    return TrainState(step=state.step + 1, trainable=trainable, opt_state=opt_state), metrics


def _fixed_order_train_step(mode: Mode, optimizer, mesh: Mesh, state: TrainState, params: Params, batch: MemoryBatch):
    """`_train_step` with the gradient summed in a fixed order (`distributed.fixed_order_sum`): each device
    differentiates the summed loss of its rows; the sums over devices, device 0 first, are divided by the
    answer tokens of the whole batch. Same bits for any process layout of the same number of devices."""

    def local(trainable, params, batch):
        trainable = distributed.as_varying(trainable)  # per-device gradients, not already summed ones
        prefix = None
        if mode == "adapter":
            prefix = jax.lax.stop_gradient(model.prefill(params, batch.observation))

        def sums(t):
            total, n, correct = answer_sums(_batch_logits(mode, t, params, batch, prefix), batch.suffix_tokens,
                                            batch.loss_mask)
            return total, (n, correct)

        (total, (n, correct)), grads = jax.value_and_grad(sums, has_aux=True)(trainable)
        n = distributed.fixed_order_sum(n)
        scale = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda g: distributed.fixed_order_sum(g) / scale, grads)
        return distributed.fixed_order_sum(total) / scale, grads, n, distributed.fixed_order_sum(correct)

    loss, grads, n, correct = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(distributed.DATA)),
                                            out_specs=P())(state.trainable, params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
    trainable = optax.apply_updates(state.trainable, updates)
    metrics = {**step_metrics(loss, grads, (trainable, opt_state)), "tokens": n, "correct": correct}
    return TrainState(step=state.step + 1, trainable=trainable, opt_state=opt_state), metrics


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh with axis "data" over the first `num_devices` devices (default: all, of every process)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"asked for {n} devices but {len(devices)} exist; on CPU simulate more with "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax starts)")
    if jax.process_count() > 1 and n != len(devices):
        raise ValueError(f"asked for {n} of the {len(devices)} devices of a {jax.process_count()}-process run; a "
                         "multi-process mesh uses every device (leave --devices out)")
    return Mesh(np.asarray(devices[:n]), (distributed.DATA,))


class TrainStep(NamedTuple):
    """A compiled step `fn(state, params, batch) -> (state, metrics)` (donates `state`) and its optimizer.

    metrics: loss, grad_norm, finite (`training.flow.train_step.step_metrics`), tokens and correct (`answer_loss`)."""

    fn: Callable[[TrainState, Params, MemoryBatch], tuple[TrainState, dict]]
    optimizer: optax.GradientTransformation


def make_train_step(config: TrainConfig, mesh: Mesh | None = None, *, fixed_order: bool = False,
                    state_sharding=None) -> TrainStep:
    """The jitted train step of `config` (cached per config, mesh and reduction when the state is replicated,
    so repeated runs compile once).

    With a mesh, the batch is sharded over its "data" axis (rows), parameters and metrics are replicated and
    the state is replicated or, given `state_sharding` (a tree of shardings matching the state, e.g.
    `distributed.state_shardings`: FSDP), laid out so: each device runs its rows and XLA all-reduces the
    gradients, or, `fixed_order`, sums them in a fixed order (`_fixed_order_train_step`: bit-identical for
    any process layout of the same number of devices).
    """
    if state_sharding is None:
        return _cached_train_step(config, mesh, fixed_order)
    return _build_train_step(config, mesh, fixed_order, state_sharding)


@functools.lru_cache(maxsize=16)
def _cached_train_step(config: TrainConfig, mesh: Mesh | None, fixed_order: bool) -> TrainStep:
    return _build_train_step(config, mesh, fixed_order, None)


def _build_train_step(config: TrainConfig, mesh: Mesh | None, fixed_order: bool, state_sharding) -> TrainStep:
    optimizer = config.optimizer()
    if mesh is None:
        if fixed_order:
            raise ValueError("the fixed-order gradient reduction needs a mesh (make_mesh)")
        return TrainStep(jax.jit(functools.partial(_train_step, config.mode, optimizer), donate_argnums=0), optimizer)
    fn = (functools.partial(_fixed_order_train_step, config.mode, optimizer, mesh) if fixed_order
          else functools.partial(_train_step, config.mode, optimizer))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(distributed.DATA))
    state_sh = rep if state_sharding is None else state_sharding
    return TrainStep(jax.jit(fn, donate_argnums=0, in_shardings=(state_sh, rep, rows), out_shardings=(state_sh, rep)),
                     optimizer)


def place(tree, mesh: Mesh | None, *, sharded: bool = False):
    """Puts a pytree on the mesh: rows split over "data" when `sharded`, else replicated (no mesh: default device)."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, tree)
    return jax.device_put(tree, NamedSharding(mesh, P("data") if sharded else P()))


@jax.jit
def teacher_forced_logits(params: Params, batch: MemoryBatch, bank: lora.LoraBank | None = None,
                          adapter: jax.Array | None = None) -> jax.Array:
    """Prefill `batch.observation` with `params`, then `suffix_logits` of its suffix: float32 [B, T, V]."""
    return suffix_logits(params, model.prefill(params, batch.observation), batch.suffix_tokens, bank, adapter)
