"""The training loop (`train`: run or resume `TrainConfig.steps` steps, log, evaluate, checkpoint); resuming
from a verified checkpoint (`training.memory.checkpoints`) is bit-identical to an uninterrupted run.

Every step reports whether its loss, gradient norm and updated state are finite; the loop reads those flags at
every log, evaluation and checkpoint and at the end, and stops at the first non-finite step
(`NonFiniteStepError`), so no evaluation, checkpoint or final state ever comes from a diverged run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence

import jax
from jax.sharding import Mesh

from oxygen_jax.models.pi05.params import Params
from training import distributed
from training.memory.checkpoints import StateCheckpoints
from training.memory.config import TrainConfig, checkpoint_config_json
from training.memory.data import StepBatches, TextTask
from training.memory.evaluate import exact_match_hits
from training.memory.model import TrainState, init_state, make_train_step, place, with_base_trainable


class NonFiniteStepError(ArithmeticError):
    """A training step produced a NaN or ±inf loss, gradient norm or state (`step`: 1-based, as logged)."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        what = (f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm}"
                if not math.isfinite(grad_norm) else "the updated state has NaN or inf entries")
        super().__init__(f"step {step}: {what} (loss {loss:g}, gradient norm {grad_norm:g}); training stopped there "
                         "and saved nothing from it (lower the learning rate or check the data)")
        self.step = step


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list[dict]  # logged metrics and evaluations, one dict per event
    frames_decoded: int = 0  # training frames this process read and decoded (its rows of every step)


def progress_label(config: TrainConfig) -> str:
    """The progress bar's label: what is trained and for which field, e.g. "memory adapter" or "scene base"
    (tqdm appends ": ", so the label itself ends in no colon)."""
    return f"{config.label_key} {config.mode}"


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
    fixed_order: bool = False,
    fsdp_min_size: int | None = None,
    log_every: int = 10,
    progress: bool = False,
    log: Callable[[dict], None] | None = None,
    run_meta: Mapping | None = None,
) -> TrainResult:
    """Runs (or resumes) `config.steps` optimisation steps; returns the final state and the metric history.

    Args:
      params: the base model (never modified in adapter mode; the frozen part in base mode).
      task: the suffix task (prompt and label key must equal `config`'s).
      eval_source, eval_every, eval_frames: greedy exact match through the slot pool on up to `eval_frames`
        frames every `eval_every` steps and at the end (0: only at the end; no source: never).
      checkpoint_dir, checkpoint_every: verified orbax checkpoints of the state every N steps and at the end;
        the newest intact checkpoint there is resumed (bit-identical continuation), damaged newer ones are
        reported ("checkpoint_rejected" events) and moved aside.
      stop_at: stop after this step (< config.steps) as if killed there (for resume tests); the schedule
        still spans `config.steps`.
      mesh: data-parallel mesh (`make_mesh`, over the devices of every process of a `training.distributed` run);
        None: one device. Each process decodes only its rows of every batch (`distributed.process_rows`).
      fixed_order: sum gradients in a fixed order (`distributed.fixed_order_sum`): the same bits for any process
        layout of the mesh's devices (needs a mesh).
      fsdp_min_size: shard trainable and optimizer leaves of at least this many elements over the mesh (FSDP,
        `distributed.fsdp_spec`); None: everything replicated.
      log: called with every history entry (e.g. a JSONL writer).
      run_meta: JSON-able identity of the run beyond the configs (e.g. the base's fingerprint, the prompt
        length), recorded with every checkpoint; resuming one recorded with other values is refused.
    Raises:
      NonFiniteStepError: a step's loss, gradient norm or state is NaN or ±inf; nothing from it or later steps
        was evaluated or saved (the last checkpoint written before it stays).
      training.memory.checkpoints.CheckpointError: checkpoints exist but none is intact, or they belong to
        another run (the differing fields named).
    """
    if (task.prompt, task.label_key, task.suffix_len) != (config.prompt, config.label_key, config.suffix_len):
        raise ValueError("the TextTask's prompt/label_key/suffix_len differ from the TrainConfig's")
    if mesh is not None and config.batch_size % mesh.devices.size:
        raise ValueError(f"batch_size {config.batch_size} is not a multiple of the {mesh.devices.size} devices of the mesh")
    rows = None if mesh is None else distributed.process_rows(mesh, config.batch_size)
    batches = StepBatches(train_source, task, params.config, batch_size=config.batch_size, seed=config.seed,
                          augment=config.augment, rows=rows)
    optimizer = config.optimizer()
    state = init_state(config, params, optimizer)
    shardings = None
    if mesh is not None:
        shardings = distributed.state_shardings(state, mesh, fsdp_min_size) if fsdp_min_size is not None else None
        state = place(state, mesh) if shardings is None else distributed.put(state, shardings)
    step_fn, _ = make_train_step(config, mesh, fixed_order=fixed_order, state_sharding=shardings)
    local_params = params  # this process's own copy: evaluation runs per process, on its share of the batches
    meta = {"train": config.to_json(), "model": checkpoint_config_json(params.config), **(run_meta or {})}
    ckpt = None if checkpoint_dir is None else StateCheckpoints(checkpoint_dir)
    history: list[dict] = []

    def emit(entry: dict):
        history.append(entry)
        if log is not None:
            log(entry)

    try:
        if ckpt is not None:
            rejected = []
            restored = ckpt.resume(state, meta, report=lambda step, why: (rejected.append(step), emit(
                {"event": "checkpoint_rejected", "step": step, "reason": why})))
            if restored is not None:
                state = restored
                emit({"event": "resumed", "step": int(state.step), "from": str(ckpt.directory),
                      **({"rejected_moved_to": str(ckpt.rejected_dir)} if rejected else {})})
        params = place(params, mesh)
        start, end = int(state.step), config.steps if stop_at is None else min(stop_at, config.steps)
        pending: list[tuple[int, dict]] = []  # steps dispatched whose metrics were not read yet
        t_last = time.perf_counter()
        bar = None

        def sync():
            """Reads the pending steps' metrics, logs every `log_every`-th, raises at the first non-finite one."""
            nonlocal pending, t_last
            if not pending:
                return
            host = jax.device_get([m for _, m in pending])
            now = time.perf_counter()
            for (s, _), m in zip(pending, host):
                if not bool(m["finite"]):
                    raise NonFiniteStepError(s, float(m["loss"]), float(m["grad_norm"]))
                if s % log_every == 0 or s == end:
                    entry = {"event": "train", "step": s, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                             "token_acc": float(m["correct"] / max(float(m["tokens"]), 1.0)),
                             "s_per_step": round((now - t_last) / len(pending), 3)}
                    emit(entry)
                    if bar is not None:
                        bar.set_postfix(loss=f"{entry['loss']:.3f}", tok_acc=f"{entry['token_acc']:.2f}")
            pending, t_last = [], now

        def evaluate(step: int):
            if eval_source is None:
                return
            t0 = time.perf_counter()
            part = (jax.process_index(), jax.process_count())
            trainable = distributed.host(state.trainable)
            if config.mode == "adapter":
                hits, judged = exact_match_hits(local_params, task, eval_source, bank=trainable,
                                                batch_size=config.batch_size, limit=eval_frames, part=part)
            else:
                hits, judged = exact_match_hits(with_base_trainable(local_params, trainable), task, eval_source,
                                                batch_size=config.batch_size, limit=eval_frames, part=part)
            total = distributed.sum_over_processes({"hits": hits, "judged": judged})
            em = total["hits"] / total["judged"]
            emit({"event": "eval", "step": step, "exact_match": em, "eval_s": round(time.perf_counter() - t0, 2)})

        if progress:
            from tqdm import tqdm

            bar = tqdm(total=end, initial=start, unit="step", desc=progress_label(config), dynamic_ncols=True)
        try:
            for step in range(start, end):
                batch = batches(step)
                batch = place(batch, None) if mesh is None else distributed.global_batch(batch, mesh, config.batch_size)
                state, metrics = step_fn(state, params, batch)
                pending.append((step + 1, metrics))
                done = step + 1
                save = ckpt is not None and checkpoint_every and done % checkpoint_every == 0 and done != end
                check = eval_every and done % eval_every == 0 and done != config.steps
                if done % log_every == 0 or done == end or save or check:
                    sync()  # before anything reads the state
                if bar is not None:
                    bar.update(1)
                if save:
                    ckpt.save(state, meta)
                if check:
                    evaluate(done)
            sync()
        finally:
            if bar is not None:
                bar.close()
        if ckpt is not None and end > start:
            ckpt.save(state, meta)
        if end == config.steps and end > start:
            evaluate(end)
        return TrainResult(state=state, history=history, frames_decoded=batches.frames_decoded)
    finally:
        if ckpt is not None:
            ckpt.close()
