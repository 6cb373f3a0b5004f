"""The training loop (`train`: run or resume `TrainConfig.steps` steps, log, evaluate, checkpoint) and the
orbax checkpoints of its state (`StateCheckpoints`); resuming is bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from oxygen_jax.models.pi05.params import Params
from training.memory.config import TrainConfig, checkpoint_config_json
from training.memory.data import StepBatches, TextTask
from training.memory.evaluate import greedy_exact_match
from training.memory.model import TrainState, init_state, make_train_step, place, with_base_trainable


# -------------------------------------------------------------------------------------------------
# Checkpoints of the training state (orbax CheckpointManager)
# -------------------------------------------------------------------------------------------------


def _leaf_names(tree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class StateCheckpoints:
    """Training-state checkpoints under `directory` (an orbax `CheckpointManager`, one step per folder).

    Each step stores the state's leaves (host copies, exact bytes) as a flat item plus a JSON item with the
    leaf names, the `TrainConfig` and the model config, so a restore can refuse a state that belongs to
    another run instead of mis-assigning leaves.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).expanduser().resolve()  # orbax needs absolute paths
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, meta: Mapping) -> None:
        leaves = jax.tree.leaves(state)
        flat = {f"{i:04d}": np.asarray(x) for i, x in enumerate(leaves)}
        step = int(np.asarray(state.step))
        info = {**meta, "leaves": _leaf_names(state), "step": step}
        ocp = self._ocp
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(info)),
                          force=True)
        self.manager.wait_until_finished()

    def restore(self, template: TrainState, meta: Mapping, step: int | None = None) -> TrainState:
        """The state saved at `step` (default the latest), checked against `template`'s tree and `meta`."""
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no training checkpoint in {self.directory}")
        info = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        names = _leaf_names(template)
        for key in ("train", "model"):
            if key in meta and info.get(key) != meta[key]:
                raise ValueError(
                    f"{self.directory}: the checkpoint at step {step} was written by a run with another {key} config "
                    f"({info.get(key)} != {meta[key]}); resume with the same flags or choose a new --out")
        if info.get("leaves") != names:
            raise ValueError(f"{self.directory}: the checkpoint's state tree differs from this run's "
                             "(mode, rank or targets changed); choose a new --out")
        leaves, treedef = jax.tree_util.tree_flatten(template)
        abstract = {f"{i:04d}": jax.ShapeDtypeStruct(x.shape, x.dtype) for i, x in enumerate(leaves)}
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        return jax.tree_util.tree_unflatten(treedef, [np.asarray(restored[f"{i:04d}"]) for i in range(len(leaves))])

    def close(self) -> None:
        self.manager.close()


# -------------------------------------------------------------------------------------------------
# Training loop
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list[dict]  # logged metrics and evaluations, one dict per event


def train(
    config: TrainConfig,
    params: Params,
    task: TextTask,
    train_source: Sequence[Mapping],
    *,
    eval_source: Sequence[Mapping] | None = None,
    eval_every: int = 0,
    eval_frames: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    stop_at: int | None = None,
    mesh: Mesh | None = None,
    log_every: int = 10,
    progress: bool = False,
    log: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Runs (or resumes) `config.steps` optimisation steps; returns the final state and the metric history.

    Args:
      params: the base model (never modified in adapter mode; the frozen part in base mode).
      task: the suffix task (prompt and label key must equal `config`'s).
      eval_source, eval_every, eval_frames: greedy exact match through the slot pool on up to `eval_frames`
        frames every `eval_every` steps and at the end (0: only at the end; no source: never).
      checkpoint_dir, checkpoint_every: orbax checkpoints of the state every N steps and at the end; an
        existing checkpoint there is resumed (bit-identical continuation).
      stop_at: stop after this step (< config.steps) as if killed there (for resume tests); the schedule
        still spans `config.steps`.
      mesh: data-parallel mesh (`make_mesh`); None: one device.
      log: called with every history entry (e.g. a JSONL writer).
    """
    if (task.prompt, task.label_key, task.suffix_len) != (config.prompt, config.label_key, config.suffix_len):
        raise ValueError("the TextTask's prompt/label_key/suffix_len differ from the TrainConfig's")
    if mesh is not None and config.batch_size % mesh.devices.size:
        raise ValueError(f"batch_size {config.batch_size} is not a multiple of the {mesh.devices.size} devices of the mesh")
    step_fn, optimizer = make_train_step(config, mesh)
    batches = StepBatches(train_source, task, params.config, batch_size=config.batch_size, seed=config.seed,
                          augment=config.augment)
    state = init_state(config, params, optimizer)
    meta = {"train": config.to_json(), "model": checkpoint_config_json(params.config)}
    ckpt = None if checkpoint_dir is None else StateCheckpoints(checkpoint_dir)
    history: list[dict] = []

    def emit(entry: dict):
        history.append(entry)
        if log is not None:
            log(entry)

    if ckpt is not None and ckpt.latest_step() is not None:
        state = ckpt.restore(state, meta)
        emit({"event": "resumed", "step": int(state.step), "from": str(ckpt.directory)})
    state = place(state, mesh)
    params = place(params, mesh)
    start, end = int(state.step), config.steps if stop_at is None else min(stop_at, config.steps)

    def evaluate(step: int):
        if eval_source is None:
            return
        t0 = time.perf_counter()
        if config.mode == "adapter":
            em = greedy_exact_match(params, task, eval_source, bank=state.trainable, batch_size=config.batch_size,
                                    limit=eval_frames)
        else:
            em = greedy_exact_match(with_base_trainable(params, state.trainable), task, eval_source,
                                    batch_size=config.batch_size, limit=eval_frames)
        emit({"event": "eval", "step": step, "exact_match": em, "eval_s": round(time.perf_counter() - t0, 2)})

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=end, initial=start, unit="step", desc=f"{config.mode} {config.prompt.strip()}",
                   dynamic_ncols=True)
    pending: list[tuple[int, dict]] = []
    t_last = time.perf_counter()
    for step in range(start, end):
        state, metrics = step_fn(state, params, place(batches(step), mesh, sharded=True))
        pending.append((step + 1, metrics))
        done = step + 1
        if done % log_every == 0 or done == end:
            host = jax.device_get([m for _, m in pending])
            now = time.perf_counter()
            for (s, _), m in zip(pending, host):
                if s % log_every == 0 or s == end:
                    entry = {"event": "train", "step": s, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                             "token_acc": float(m["correct"] / max(float(m["tokens"]), 1.0)),
                             "s_per_step": round((now - t_last) / len(pending), 3)}
                    emit(entry)
                    if bar is not None:
                        bar.set_postfix(loss=f"{entry['loss']:.3f}", tok_acc=f"{entry['token_acc']:.2f}")
            pending, t_last = [], now
        if bar is not None:
            bar.update(1)
        if ckpt is not None and checkpoint_every and done % checkpoint_every == 0 and done != end:
            ckpt.save(state, meta)
        if eval_every and done % eval_every == 0 and done != config.steps:
            evaluate(done)
    if bar is not None:
        bar.close()
    if ckpt is not None and end > start:
        ckpt.save(state, meta)
    if end == config.steps and end > start:
        evaluate(end)
    if ckpt is not None:
        ckpt.close()
    return TrainResult(state=state, history=history)
