"""Suffix-only language LoRA (textual memory) and base pre-training on a text task, with optax.

    python -m training.memory_lora --mode base --preset demo --train-tokenizer 512 --data DS --out B  # "Scene: "
    python -m training.memory_lora --base B/base --data DS --out A       # then the "Memory: " adapter on top
    python -m training.memory_lora export-demo --base B/base --adapter A/adapter --data DS   # checkpoints/demo

(the exact commands of the shipped demo are in checkpoints/demo/README.md).

Axes (`oxygen_jax.axes`): B batch rows, T suffix tokens (request prompt ‖ answer ‖ EOS ‖ padding), P prefix
tokens, V vocabulary, L layers, E stored adapters (1 here: adapter id 1; id 0 = base weights).

One loss, one forward, the serving path:

    [ prefix: cameras + task prompt | "Memory: " | answer + EOS | pad ]
      model.prefill                   decode.suffix_forward (causal, teacher-forced): the slot pool's
                                      request-prompt pass, with the LoRA bank and per-row adapter ids

cross-entropy on the answer tokens only (`MemoryBatch.loss_mask`; the logits at suffix position j predict
token j + 1), logits through the same final norm and tied head as admission (`suffix_logits`).

Two modes:

* `adapter`: a LoRA bank (`lora.init_bank`, B = 0, so step 0 is exactly the base model) is the only thing
  differentiated and updated. The prefix cache is computed before `jax.grad` (and stop-gradient'ed) and the
  base parameters are a plain, non-differentiated argument of the step: they cannot change.
* `base`: full fine-tune of the VLM expert, SigLIP and the token embedding on a text task through the same
  suffix path (prefix inside the gradient), e.g. "Scene: ..." descriptions standing in for a VLM's
  pretraining. The action expert and the action/time projections are not in the optimised tree.

Optimisation: optax AdamW after global-norm clipping, warm-up + cosine schedule (`training.train_step`'s
`make_optimizer`). Data: `training.memory_data` frames; the batch of step s is a pure function of (seed, s)
(`epoch_batches`), so a resumed run sees exactly the batches an uninterrupted one would. State (step,
trainable leaves, optimizer state) is saved by an orbax `CheckpointManager`; resuming is bit-identical.
Data parallelism: the batch is sharded over the `data` axis of a `jax.sharding.Mesh`, parameters, bank and
optimizer state are replicated (`make_mesh`).

Held-out evaluation decodes greedily through the real slot pool (`oxygen_jax.runtime.engine.Engine`, one frame per
batch), not by teacher forcing.

A trained adapter is saved as an orbax item of openpi-named LoRA leaves plus `adapter.json` (name, rank,
alpha, targets, prompt, base checkpoint and its fingerprint, per-leaf SHA-256): `save_adapter`,
`load_adapter`, `load_bank` (what an engine needs: `Engine(params, cfg, tok, bank=bank, adapter_names=names)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import io
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oxygen_jax.runtime import decode
from oxygen_jax.models.pi05 import gemma
from oxygen_jax.models import lora
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.pi05.config import (
    ExpertConfig, ModelConfig, RobotConfig, SiglipConfig, model_config, robot_config,
)
from oxygen_jax.models.pi05.params import Expert, Params, Siglip
from oxygen_jax.cli import OneLineParser, existing, int_at_least
from oxygen_jax.robots.tokenizer import Tokenizer, encode_suffix_prompt
from training.memory_data import MEMORY_PROMPT, MemoryBatch, epoch_batches, frame_texts, make_memory_batch
from training.train_step import OptimizerConfig, make_optimizer

Mode = Literal["adapter", "base"]
ADAPTER_FORMAT = 1
DEFAULT_ADAPTER_NAME = "memory"
MIN_TRAINED_VOCAB = 300  # a trained BPE needs its 256 byte pieces, the characters and the specials
DEMO_PROMPT_LEN = 48  # default Tp: LIBERO instructions (<= 44 tokens with the built-in demo tokenizer) + BOS + "\n"


# -------------------------------------------------------------------------------------------------
# Configs
# -------------------------------------------------------------------------------------------------


def demo_model_config(vocab_size: int, *, image_size: int = 224, patch_size: int = 16) -> ModelConfig:
    """The embedded demo's π0.5 shape: 4-layer experts (VLM 128 wide, action 64), a 3-layer SigLIP 128 wide
    reading 224 px images in 16 px patches (14 × 14 per camera).

    2.16 M parameters (8.6 MB in float32) at vocabulary 512: small enough to ship in the repository and to
    train on two CPU cores (~1-2 s per batch of 16 under load), with full-resolution LIBERO frames (objects in
    the basket are a few pixels; at 112 px held-out accuracy was lower in the same number of steps).
    """
    return ModelConfig(
        vlm=ExpertConfig(width=128, depth=4, mlp_dim=512, num_heads=4, num_kv_heads=1, head_dim=32),
        action_expert=ExpertConfig(width=64, depth=4, mlp_dim=256, num_heads=4, num_kv_heads=1, head_dim=32),
        siglip=SiglipConfig(width=128, depth=3, mlp_dim=512, num_heads=4, patch_size=patch_size, image_size=image_size),
        vocab_size=vocab_size,
    )


def preset_config(name: str, vocab_size: int, image_size: int | None = None, patch_size: int | None = None
                  ) -> ModelConfig:
    """'tiny' (the test preset; vocabulary 1024) or 'demo' (`demo_model_config`), optionally at another image
    size / patch size."""
    if name == "demo":
        kw = {k: v for k, v in (("image_size", image_size), ("patch_size", patch_size)) if v is not None}
        return demo_model_config(vocab_size, **kw)
    if name != "tiny":
        raise ValueError(f"unknown preset {name!r}; use 'tiny' or 'demo' (or start from a checkpoint with --base)")
    cfg = model_config("tiny")
    if vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} ids but the tiny preset's vocabulary is {cfg.vocab_size}")
    if image_size is not None or patch_size is not None:
        cfg = cfg.replace(siglip=dataclasses.replace(cfg.siglip, image_size=image_size or cfg.siglip.image_size,
                                                     patch_size=patch_size or cfg.siglip.patch_size))
    return cfg


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What one training run optimises and how (`steps` and the schedule define the run; see `optimizer`).

    Attributes:
      mode: "adapter" (LoRA bank only) or "base" (VLM expert + SigLIP + embedding).
      prompt, label_key: the suffix task, e.g. ("Memory: ", "memory") or ("Scene: ", "scene").
      steps: optimisation steps in all (a resumed run continues to the same total).
      batch_size: B rows per step (a multiple of the mesh's data axis).
      suffix_len: T; must hold prompt + the longest label + EOS.
      rank, alpha, targets: the adapter (alpha default = rank, i.e. scaling 1); ignored in base mode.
      peak_lr, final_lr, warmup_steps, weight_decay, clip_norm: AdamW, warm-up + cosine to final_lr at `steps`.
      seed: batch order, adapter init and augmentation draws.
      augment: training-image augmentation strength, 0 = none: each camera image is shifted by up to
        `augment` of its side (edge-padded crop) and its brightness scaled by 1 ± augment, drawn per
        (seed, step, row), so a resumed run sees the same pixels.
    """

    mode: Mode = "adapter"
    prompt: str = MEMORY_PROMPT
    label_key: str = "memory"
    steps: int = 300
    batch_size: int = 16
    suffix_len: int = 32
    rank: int = 8
    alpha: float | None = None
    targets: tuple[str, ...] = lora.TARGETS
    peak_lr: float = 3e-3
    final_lr: float = 1e-4
    warmup_steps: int = 20
    weight_decay: float = 1e-4
    clip_norm: float = 1.0
    seed: int = 0
    augment: float = 0.0

    def __post_init__(self):
        if self.mode not in ("adapter", "base"):
            raise ValueError(f"TrainConfig.mode must be 'adapter' or 'base', got {self.mode!r}")
        for f in ("steps", "batch_size", "suffix_len", "rank"):
            if getattr(self, f) < 1:
                raise ValueError(f"TrainConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.warmup_steps < 0 or not self.peak_lr > 0 or self.final_lr < 0:
            raise ValueError("TrainConfig: need warmup_steps >= 0, peak_lr > 0 and final_lr >= 0")
        if not 0.0 <= self.augment < 0.5:
            raise ValueError(f"TrainConfig.augment must be in [0, 0.5), got {self.augment}")
        bad = [t for t in self.targets if t not in lora.TARGETS]
        if bad or not self.targets:
            raise ValueError(f"TrainConfig.targets must be a non-empty subset of {lora.TARGETS}, got {self.targets}")

    def optimizer(self) -> optax.GradientTransformation:
        """AdamW (b1 0.9, b2 0.95) after clipping at `clip_norm`; warm-up then cosine decay to `final_lr` at `steps`."""
        return make_optimizer(OptimizerConfig(
            peak_lr=self.peak_lr, final_lr=self.final_lr, warmup_steps=self.warmup_steps,
            decay_steps=max(self.steps, self.warmup_steps + 1), weight_decay=self.weight_decay, clip_norm=self.clip_norm,
        ))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "TrainConfig":
        d = dict(d)
        d["targets"] = tuple(d["targets"])
        return cls(**d)


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
        trainable = lora.init_bank(params.config, 1, config.rank, config.alpha, config.seed, targets=config.targets,
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

    Exactly the slot pool's admission computation at every suffix position: `decode.suffix_forward`, then per
    position the final RMSNorm of [B, 1, D] and the tied head in vocabulary-major form [V, D]·[D, B], so
    entry [b, j] is, bit for bit, what admission samples from when row b's request prompt is
    `tokens[b, :j + 1]` and the admission batch has these B rows (tested). The per-position loop is what
    makes it exact: normalising [B, T, D] at once, or one [V, D]·[D, B·T] product, lets XLA vectorise the
    sums differently and changes last bits.

    Args:
      prefix: `PrefixCache` with B rows (row b continues sequence b).
      tokens: int32 [B, T]; bank, adapter: optional LoRA bank and int32 [B] adapter ids.
    """
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    _, _, h = decode.suffix_forward(params, prefix, rows, tokens, bank, adapter)

    def position(h_j):  # [B, D] -> [V, B], as admission computes its seed logits
        normed, _ = gemma.rms_norm(h_j[:, None, :], params.vlm.final_norm)
        return model.lm_logits_vocab_major(params, normed[:, 0])

    return jax.lax.map(position, jnp.swapaxes(h, 0, 1)).transpose(2, 0, 1)  # [T, V, B] -> [B, T, V]


def answer_loss(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, dict]:
    """Mean cross-entropy of the answer tokens (targets `tokens[:, 1:]` where `loss_mask[:, 1:]`).

    Args:
      logits: float32 [B, T, V] (`suffix_logits`); tokens int32 [B, T]; loss_mask bool [B, T].
    Returns:
      (loss [], {"tokens": answer tokens counted, "correct": teacher-forced argmax hits}).
    """
    lg, targets = logits[:, :-1], tokens[:, 1:]
    w = loss_mask[:, 1:].astype(jnp.float32)
    logp = jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    n = jnp.sum(w)
    loss = jnp.sum(nll * w) / jnp.maximum(n, 1.0)
    correct = jnp.sum((jnp.argmax(lg, axis=-1) == targets) * w)
    return loss, {"tokens": n, "correct": correct}


def batch_loss(mode: Mode, trainable, params: Params, batch: MemoryBatch, prefix=None):
    """(loss, stats) of one batch; `prefix` (adapter mode) is the base model's cache of `batch.observation`."""
    if mode == "adapter":
        ids = jnp.ones((batch.suffix_tokens.shape[0],), jnp.int32)
        logits = suffix_logits(params, prefix, batch.suffix_tokens, trainable, ids)
    else:
        params = with_base_trainable(params, trainable)
        logits = suffix_logits(params, model.prefill(params, batch.observation), batch.suffix_tokens)
    return answer_loss(logits, batch.suffix_tokens, batch.loss_mask)


def _train_step(mode: Mode, optimizer, state: TrainState, params: Params, batch: MemoryBatch):
    prefix = None
    if mode == "adapter":
        # Outside jax.grad: the base model's prefix is data for the adapter, never differentiated.
        prefix = jax.lax.stop_gradient(model.prefill(params, batch.observation))
    grad_fn = jax.value_and_grad(lambda t: batch_loss(mode, t, params, batch, prefix), has_aux=True)
    (loss, stats), grads = grad_fn(state.trainable)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
    trainable = optax.apply_updates(state.trainable, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **stats}
    return TrainState(step=state.step + 1, trainable=trainable, opt_state=opt_state), metrics


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh with axis "data" over the first `num_devices` devices (default: all)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"asked for {n} devices but {len(devices)} exist; on CPU simulate more with "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax starts)")
    return Mesh(np.asarray(devices[:n]), ("data",))


class TrainStep(NamedTuple):
    """A compiled step `fn(state, params, batch) -> (state, metrics)` (donates `state`) and its optimizer."""

    fn: Callable[[TrainState, Params, MemoryBatch], tuple[TrainState, dict]]
    optimizer: optax.GradientTransformation


@functools.lru_cache(maxsize=16)
def make_train_step(config: TrainConfig, mesh: Mesh | None = None) -> TrainStep:
    """The jitted train step of `config` (cached per config and mesh, so repeated runs compile once).

    With a mesh, the batch is sharded over its "data" axis (rows), and state, parameters and metrics are
    replicated: each device runs its rows and XLA all-reduces the gradients.
    """
    optimizer = config.optimizer()
    fn = functools.partial(_train_step, config.mode, optimizer)
    if mesh is None:
        return TrainStep(jax.jit(fn, donate_argnums=0), optimizer)
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return TrainStep(jax.jit(fn, donate_argnums=0, in_shardings=(rep, rep, rows), out_shardings=(rep, rep)), optimizer)


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


# -------------------------------------------------------------------------------------------------
# Data
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TextTask:
    """How frames become batches: the robot's observation transform, tokenizer and suffix task."""

    robot: RobotConfig
    tokenizer: Tokenizer
    prompt: str
    label_key: str
    suffix_len: int

    def batch(self, frames: Sequence[Mapping], model_config: ModelConfig) -> MemoryBatch:
        return make_memory_batch(frames, self.robot, model_config, self.tokenizer, suffix_len=self.suffix_len,
                                 prompt=self.prompt, label_key=self.label_key)

    @property
    def prompt_ids(self) -> list[int]:
        return encode_suffix_prompt(self.tokenizer, self.prompt)


class StepBatches:
    """The batch of every step as a pure function of (seed, step): epoch = step // batches per epoch, rows from
    `epoch_batches(..., seed, epoch)` (full batches only). Resuming at any step needs no iterator state."""

    def __init__(self, source: Sequence[Mapping], task: TextTask, model_config: ModelConfig, *, batch_size: int,
                 seed: int, augment: float = 0.0):
        self.source, self.task, self.model_config = source, task, model_config
        self.batch_size, self.seed, self.augment = batch_size, seed, augment
        self.per_epoch = len(source) // batch_size
        if self.per_epoch == 0:
            raise ValueError(f"the training split has {len(source)} frames, fewer than batch_size={batch_size}")
        self._epoch: tuple[int, list[np.ndarray]] | None = None

    def indices(self, step: int) -> np.ndarray:
        epoch, i = divmod(int(step), self.per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_batches(len(self.source), batch_size=self.batch_size, seed=self.seed,
                                                epoch=epoch))
        return self._epoch[1][i]

    def __call__(self, step: int) -> MemoryBatch:
        idx = self.indices(step)
        frames = [self.source[int(i)] for i in idx]
        if self.augment:
            frames = [augment_frame(f, self.augment, np.random.default_rng([self.seed, int(step), r]))
                      for r, f in enumerate(frames)]
        try:
            return self.task.batch(frames, self.model_config)
        except (ValueError, KeyError) as e:
            raise ValueError(f"step {step}, frames {idx.tolist()}: {e}") from e


def augment_frame(frame: Mapping, strength: float, rng: np.random.Generator) -> dict:
    """A copy of `frame` whose camera images are shifted (edge-padded, up to `strength` of the side in each
    direction) and brightness-scaled by a factor in [1 - strength, 1 + strength], independently per camera."""
    out = dict(frame)
    for key in ("image", "wrist_image"):
        img = np.asarray(frame[key])
        h, w = img.shape[:2]
        m = int(round(strength * min(h, w)))
        dy, dx = rng.integers(0, 2 * m + 1, 2)
        padded = np.pad(img, ((m, m), (m, m), (0, 0)), mode="edge")
        crop = padded[dy:dy + h, dx:dx + w].astype(np.float32) * rng.uniform(1 - strength, 1 + strength)
        out[key] = np.clip(np.round(crop), 0, 255).astype(np.uint8)
    return out


def fixed_batches(source: Sequence[Mapping], task: TextTask, model_config: ModelConfig, batch_size: int,
                  limit: int | None = None) -> list[tuple[MemoryBatch, int]]:
    """In-order batches of the first `limit` frames (all by default): [(batch, real rows)], the last one padded
    with copies of its first frame (their loss mask is all False)."""
    n = len(source) if limit is None else min(limit, len(source))
    out = []
    for start in range(0, n, batch_size):
        frames = [source[i] for i in range(start, min(start + batch_size, n))]
        real = len(frames)
        frames += [frames[0]] * (batch_size - real)
        batch = task.batch(frames, model_config)
        if real < batch_size:
            mask = batch.loss_mask.copy()
            mask[real:] = False
            batch = dataclasses.replace(batch, loss_mask=mask)
        out.append((batch, real))
    return out


def task_texts(source: Sequence[Mapping], keys: Sequence[str] = ("language_instruction", "memory", "scene")) -> list[str]:
    """Distinct texts of the given frame keys (those present), in first-seen order: a tokenizer corpus."""
    seen: dict[str, None] = {}
    for frame in frame_texts(source, keys):  # no image decoding
        for k in keys:
            if k in frame:
                seen.setdefault(str(frame[k]), None)
    return list(seen)


def train_text_tokenizer(texts: Sequence[str], vocab_size: int = 640) -> Tokenizer:
    """A BPE tokenizer with PaliGemma's id layout (pad 0, eos 1, bos 2, unk 3), trained in memory on `texts`.

    Same options as `oxygen_jax.robots.tokenizer.train_demo_tokenizer` (identity normalisation, whitespace kept, split
    digits, byte fallback: any text round-trips), deterministic (one thread, unshuffled input). Trained on a
    task's own labels and instructions, its pieces are whole words, so labels are short token sequences.
    """
    import sentencepiece as spm

    if vocab_size < MIN_TRAINED_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_TRAINED_VOCAB} (256 byte pieces + characters + specials), "
                         f"got {vocab_size}")
    lines = [t for t in texts if t]
    if not lines:
        raise ValueError("train_text_tokenizer needs at least one non-empty text")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=True,
        character_coverage=1.0, hard_vocab_limit=False, num_threads=1, shuffle_input_sentence=False, minloglevel=2,
    )
    return Tokenizer.from_bytes(buf.getvalue())


# -------------------------------------------------------------------------------------------------
# Greedy answers through the real slot pool
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EngineAnswers:
    """Per frame, in source order: generated `texts` and `tokens` (EOS excluded), `actions` float32 [n, Ha, Ad]."""

    texts: list[str]
    tokens: list[list[int]]
    actions: np.ndarray


def engine_answers(
    params: Params,
    task: TextTask,
    batches: Sequence[tuple[MemoryBatch, int]],
    *,
    bank: lora.LoraBank | None = None,
    adapter: str = "base",
    adapter_name: str = DEFAULT_ADAPTER_NAME,
    max_new_tokens: int | None = None,
    num_steps: int = 2,
    noise_seed: int = 0,
) -> EngineAnswers:
    """Greedy answers to `task.prompt` for every real row, served by `Engine` (one control frame per batch).

    Each batch is one frame: its B observations are prefilled once, an action chunk is denoised from the
    prefix (noise fixed per batch by `noise_seed`, so actions are comparable across banks), and one request
    per real row (`adapter` = "base" or `adapter_name`) is admitted and decoded to EOS or the budget.
    """
    from oxygen_jax.runtime.engine import Engine, EngineConfig# the host engine (not needed for training itself)

    b = batches[0][0].batch_size
    prompt = task.prompt_ids
    budget = max_new_tokens or max(1, task.suffix_len - len(prompt))
    horizon = task.robot.action_horizon
    engine = Engine(params, EngineConfig(num_slots=b, max_new_tokens=budget, prompt_capacity=len(prompt),
                                         admissions_per_frame=b, tokens_per_frame=budget, num_steps=num_steps,
                                         action_horizon=horizon, seed=noise_seed),
                    None, bank=bank, adapter_names=() if bank is None else (adapter_name,))  # detokenised below
    texts, tokens, actions = [], [], []
    for k, (batch, real) in enumerate(batches):
        obs = jax.tree.map(jnp.asarray, batch.observation)
        noise = jax.random.normal(jax.random.fold_in(jax.random.key(noise_seed), k), (b, horizon, params.config.action_dim))
        ids = {engine.submit(prompt_tokens=prompt, max_tokens=budget, adapter=adapter, row=r): r for r in range(real)}
        done: dict[int, tuple[str, list[int]]] = {}
        for frame in range(budget + 1):  # one frame finishes every request (k = budget); more is a bug
            if len(done) == real:
                break
            res = engine.step(obs, noise=noise)
            if frame == 0:
                actions.append(np.asarray(res.actions[:real]))
            for f in res.finished:
                toks = [t for t in f.tokens if t != task.tokenizer.eos_id]
                done[ids[f.request_id]] = (_detokenize(task.tokenizer, toks), toks)
            if res.errors:
                raise RuntimeError(f"engine_answers: request failed: {res.errors[0].reason}")
        if len(done) < real:
            raise RuntimeError(f"engine_answers: {real - len(done)} requests did not finish in {budget + 1} frames")
        for r in range(real):
            texts.append(done[r][0])
            tokens.append(done[r][1])
    return EngineAnswers(texts=texts, tokens=tokens, actions=np.concatenate(actions))


def _detokenize(tokenizer: Tokenizer, tokens: Sequence[int]) -> str:
    """Text of generated ids; ids beyond the tokenizer (a model vocabulary padded past it) read "<id N>"."""
    out, run = [], []
    for t in tokens:
        if 0 <= t < tokenizer.vocab_size:
            run.append(t)
            continue
        out += [tokenizer.decode(run), f"<id {t}>"]
        run = []
    return "".join(out + [tokenizer.decode(run)])


def normalize_answer(text: str) -> str:
    """Exact-match normal form: strip, collapse whitespace, case-fold, one trailing period optional."""
    text = " ".join(str(text).split()).casefold()
    return text[:-1].rstrip() if text.endswith(".") else text


def greedy_exact_match(params: Params, task: TextTask, source: Sequence[Mapping], *, bank=None, batch_size: int = 16,
                       limit: int | None = None) -> float:
    """Held-out greedy exact match (normalised) of `task` answers decoded by the slot pool (adapter id 1 when
    a bank is given)."""
    batches = fixed_batches(source, task, params.config, batch_size, limit)
    out = engine_answers(params, task, batches, bank=bank, adapter="base" if bank is None else DEFAULT_ADAPTER_NAME,
                         num_steps=1)
    refs = [str(f[task.label_key]) for f in frame_texts(source, (task.label_key,), len(out.texts))]
    return float(np.mean([normalize_answer(p) == normalize_answer(r) for p, r in zip(out.texts, refs)]))


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


def checkpoint_config_json(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


# -------------------------------------------------------------------------------------------------
# Adapter files
# -------------------------------------------------------------------------------------------------


def _sha256(x) -> str:
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()


def tree_digest(tree) -> str:
    """SHA-256 over every leaf's bytes (tree order): equal digests mean bit-identical leaves."""
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(_sha256(jax.device_get(x)).encode())
    return h.hexdigest()


def base_fingerprint(base_dir: str | os.PathLike) -> str | None:
    """SHA-256 of a `checkpoint.save_params` directory's checksums item (identifies its arrays), or None."""
    path = Path(base_dir) / "checksums" / "metadata"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def save_adapter(
    path: str | os.PathLike,
    adapter: lora.ExpertLora,
    *,
    name: str = DEFAULT_ADAPTER_NAME,
    prompt: str = MEMORY_PROMPT,
    base: str | os.PathLike | None = None,
    extra: Mapping | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes one VLM-expert adapter (leaves [L, ...]) to the new directory `path`.

    Layout: `lora/` (orbax PyTree item, openpi LoRA paths such as
    `PaliGemma/llm/layers/attn/q_einsum/lora_a`) and `adapter.json` (format, name, prompt, rank, alpha, rslora,
    targets, expert, the base checkpoint path and fingerprint, each leaf's shape/dtype/SHA-256, `extra`).
    """
    import orbax.checkpoint as ocp

    dest = Path(path).expanduser().resolve()
    if dest.exists():
        if not overwrite:
            raise FileExistsError(f"adapter directory already exists: {dest} (pass overwrite=True to replace it)")
        import shutil

        shutil.rmtree(dest)
    flat = {k: np.asarray(v) for k, v in lora.to_openpi(lora.ModelLora(vlm=adapter, action_expert=None)).items()}
    meta = {
        "format": ADAPTER_FORMAT, "name": name, "prompt": prompt, "expert": "vlm",
        "rank": adapter.attn_rank or adapter.ffn_rank, "alpha": adapter.alpha, "rslora": adapter.rslora,
        "targets": list(adapter.pairs()),
        "base": None if base is None else str(Path(base).expanduser().resolve()),
        "base_fingerprint": None if base is None else base_fingerprint(base),
        "leaves": {k: {"shape": list(v.shape), "dtype": v.dtype.name, "sha256": _sha256(v)} for k, v in flat.items()},
        **({"extra": dict(extra)} if extra else {}),
    }
    dest.mkdir(parents=True)
    nested: dict = {}
    for k, v in flat.items():  # openpi's nested layout: "/"-separated path components
        node = nested
        *parents, leaf = k.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = v
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(dest / "lora", nested)
    (dest / "adapter.json").write_text(json.dumps(meta, indent=1) + "\n")
    return dest


def load_adapter(path: str | os.PathLike, config: ModelConfig, *, base: str | os.PathLike | None = None
                 ) -> tuple[lora.ExpertLora, dict]:
    """Reads a `save_adapter` directory for the model `config` (its VLM expert).

    Args:
      base: the base checkpoint the adapter will run on; when given and the adapter recorded a fingerprint,
        a different base is an error (an adapter trained on other weights produces garbage).
    Returns:
      (adapter with leaves [L, ...] float32, its adapter.json dict).
    Raises:
      FileNotFoundError / ValueError: one line naming the file or field; a shape mismatch lists every leaf.
    """
    import orbax.checkpoint as ocp

    src = Path(path).expanduser().resolve()
    meta_file = src / "adapter.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{src} is not an adapter directory (no adapter.json); write one with save_adapter")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:
        raise ValueError(f"{meta_file} is not valid JSON ({e}); the adapter directory is damaged") from e
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{meta_file}: unknown adapter format {meta.get('format')!r} (this code reads {ADAPTER_FORMAT})")
    if base is not None and meta.get("base_fingerprint"):
        got = base_fingerprint(base)
        if got is not None and got != meta["base_fingerprint"]:
            raise ValueError(f"adapter {src} was trained on base {meta.get('base')} but {Path(base).resolve()} holds "
                             "other weights (checksums differ); use the base it was trained on")
    try:
        nested = ocp.PyTreeCheckpointer().restore(src / "lora")
    except Exception as e:  # noqa: BLE001 - orbax raises many types; report one line
        raise ValueError(f"{src / 'lora'}: cannot read the adapter arrays ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    flat = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, Mapping):
                walk(v, f"{prefix}{k}/")
            else:
                flat[f"{prefix}{k}"] = np.asarray(v)

    walk(nested, "")
    for k, entry in meta.get("leaves", {}).items():
        if k not in flat:
            raise ValueError(f"{src}: leaf {k!r} listed in adapter.json is missing from lora/")
        if _sha256(flat[k]) != entry["sha256"]:
            raise ValueError(f"{src}: leaf {k!r} does not match its SHA-256 in adapter.json; the adapter is damaged")
    model_lora = lora.from_openpi(flat, config, alpha={"vlm": meta["alpha"]}, rslora=bool(meta.get("rslora", False)))
    if model_lora is None or model_lora.vlm is None:
        raise ValueError(f"{src}: no VLM-expert LoRA leaves found")
    adapter = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), model_lora.vlm)
    lora.check_adapter(adapter, config)
    return adapter, meta


def load_bank(paths: Sequence[str | os.PathLike], config: ModelConfig, *, base: str | os.PathLike | None = None
              ) -> tuple[lora.LoraBank, tuple[str, ...]]:
    """Stacks saved adapters into a bank for `Engine(..., bank=bank, adapter_names=names)` (ids 1..E in order).

    Raises ValueError listing every mismatched leaf when an adapter does not fit the model or the others.
    """
    adapters, names = [], []
    for p in paths:
        adapter, meta = load_adapter(p, config, base=base)
        adapters.append(adapter)
        names.append(meta["name"])
    return lora.stack_adapters(adapters, config), tuple(names)


# -------------------------------------------------------------------------------------------------
# CLI
# -------------------------------------------------------------------------------------------------


def _robot(prompt_len: int) -> RobotConfig:
    return robot_config("libero", max_token_len=prompt_len)


def _load_base(args, tokenizer: Tokenizer) -> tuple[Params, str]:
    from oxygen_jax.ckpts import checkpoint
    from oxygen_jax.models.pi05.params import init_params

    if args.base is not None:
        _, params = checkpoint.restore_params(args.base)
        what = f"checkpoint {Path(args.base).resolve()}"
    else:
        cfg = preset_config(args.preset, tokenizer.vocab_size, args.image_size, args.patch_size)
        params = init_params(cfg, args.seed)
        what = f"random {args.preset} preset (seed {args.seed})"
    if tokenizer.vocab_size > params.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                         f"{params.config.vocab_size}; use the tokenizer the base was trained with (--tokenizer)")
    return params, what


def _tokenizer(args, train_source) -> Tokenizer:
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer

    if args.tokenizer is not None:
        return Tokenizer.from_file(args.tokenizer)
    if args.base is not None and (Path(args.base).parent / "tokenizer.model").is_file():
        return Tokenizer.from_file(Path(args.base).parent / "tokenizer.model")
    if args.train_tokenizer:  # the task's texts plus both request prompts, so each prompt is a few pieces
        return train_text_tokenizer([MEMORY_PROMPT, "Scene: ", *task_texts(train_source)], args.train_tokenizer)
    return train_demo_tokenizer()


def _tokenizer_vocab(text: str) -> int:
    """--train-tokenizer: 0 (the built-in demo tokenizer) or a BPE size with room for the byte pieces."""
    value = int_at_least(0)(text)
    if 0 < value < MIN_TRAINED_VOCAB:
        raise argparse.ArgumentTypeError(
            f"expected 0 or a vocabulary of at least {MIN_TRAINED_VOCAB} (256 byte pieces + characters + specials), "
            f"got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m training.memory_lora",
        description="Train a suffix-only language LoRA (default: the 'Memory: ' adapter) on a base π0.5, or "
                    "pre-train the base (VLM expert + SigLIP + embedding) on a text task with --mode base. "
                    "Data: a memory dataset folder (training.memory_data / training.synthetic_memory / "
                    "training.libero_memory --export-tfds). Resumes from OUT/checkpoints when it exists.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Outputs in OUT: adapter/ (adapter mode: load with training.memory_lora.load_bank) or base/ (base "
               "mode: oxygen_jax.ckpts.checkpoint.restore_params), tokenizer.model, checkpoints/ (orbax, for resuming), "
               "metrics.jsonl, run.json. Assemble the embedded demo folder from a base and an adapter run with "
               "`python -m training.memory_lora export-demo --help`.",
    )
    p.add_argument("--data", type=Path, required=True, help="memory dataset version folder (tfds, array_record)")
    p.add_argument("--out", type=Path, required=True, help="output directory (created; an existing one is resumed)")
    p.add_argument("--mode", choices=("adapter", "base"), default="adapter",
                   help="adapter: LoRA bank only, base frozen; base: fine-tune VLM expert + SigLIP + embedding")
    m = p.add_argument_group("model")
    m.add_argument("--base", type=Path, default=None,
                   help="base checkpoint (checkpoint.save_params dir, e.g. OUT_OF_BASE_RUN/base); required for adapters")
    m.add_argument("--preset", choices=("tiny", "demo"), default="demo", help="random init for --mode base without --base")
    m.add_argument("--image-size", type=int_at_least(28), default=None, help="SigLIP image side of the preset (default: preset's)")
    m.add_argument("--patch-size", type=int_at_least(1), default=None, help="SigLIP patch side of the preset (default: 14)")
    m.add_argument("--tokenizer", type=Path, default=None,
                   help="SentencePiece model (default: BASE/../tokenizer.model if present, else see --train-tokenizer)")
    m.add_argument("--train-tokenizer", type=_tokenizer_vocab, default=0, metavar="VOCAB",
                   help="train a BPE tokenizer of this size on the train split's texts (0: the built-in demo tokenizer)")
    m.add_argument("--prompt-len", type=int_at_least(1), default=DEMO_PROMPT_LEN, help="Tp: task-prompt tokens in the prefix")
    t = p.add_argument_group("task")
    t.add_argument("--prompt", default=None, help="request prompt (default 'Memory: ', or 'Scene: ' in base mode)")
    t.add_argument("--label-key", default=None, help="frame field to predict (default memory, or scene in base mode)")
    t.add_argument("--train-split", default="train")
    t.add_argument("--eval-split", default="heldout")
    t.add_argument("--suffix-len", type=int_at_least(2), default=None, help="T (default: longest prompt + label + EOS in train)")
    o = p.add_argument_group("optimisation")
    d = TrainConfig()
    o.add_argument("--steps", type=int_at_least(1), default=d.steps)
    o.add_argument("--batch-size", type=int_at_least(1), default=d.batch_size)
    o.add_argument("--rank", type=int_at_least(1), default=d.rank)
    o.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: rank)")
    o.add_argument("--targets", default=",".join(d.targets), help="comma-separated LoRA targets")
    o.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3 adapter, 1e-3 base)")
    o.add_argument("--final-lr", type=float, default=None, help="end of the cosine (default peak / 30)")
    o.add_argument("--warmup", type=int_at_least(0), default=d.warmup_steps)
    o.add_argument("--weight-decay", type=float, default=d.weight_decay)
    o.add_argument("--clip-norm", type=float, default=d.clip_norm)
    o.add_argument("--seed", type=int, default=d.seed, help="batch order, adapter init, random base, augmentation")
    o.add_argument("--augment", type=float, default=d.augment,
                   help="image augmentation: random shift up to this fraction of the side, brightness x(1 +- it)")
    o.add_argument("--devices", type=int_at_least(1), default=None, help="data-parallel devices (default: all)")
    e = p.add_argument_group("evaluation and checkpoints")
    e.add_argument("--eval-every", type=int_at_least(0), default=100, help="held-out greedy exact match every N steps (0: at the end)")
    e.add_argument("--eval-frames", type=int_at_least(1), default=None, help="held-out frames per evaluation (default: all)")
    e.add_argument("--checkpoint-every", type=int_at_least(1), default=50, help="save the training state every N steps")
    e.add_argument("--stop-at", type=int_at_least(1), default=None, help="stop after this step as if killed (resume later)")
    e.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export-demo"]:
        return _export_main(argv[1:])
    args = _parser().parse_args(argv)
    from oxygen_jax.ckpts import checkpoint
    from oxygen_jax.models.pi05.params import for_backend
    from training.memory_data import open_memory_dataset

    base_mode = args.mode == "base"
    prompt = args.prompt if args.prompt is not None else ("Scene: " if base_mode else MEMORY_PROMPT)
    label_key = args.label_key or ("scene" if base_mode else "memory")
    if not base_mode and args.base is None:
        print("python -m training.memory_lora: error: adapter mode needs --base (a checkpoint.save_params dir)",
              file=sys.stderr)
        return 2
    try:
        train_src = open_memory_dataset(args.data, args.train_split)
        eval_src = open_memory_dataset(args.data, args.eval_split) if args.eval_split else None
    except (FileNotFoundError, ValueError) as e:
        print(f"python -m training.memory_lora: error: --data {args.data}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok_file = out / "tokenizer.model"
    tokenizer = Tokenizer.from_file(tok_file) if tok_file.is_file() and args.tokenizer is None else _tokenizer(args, train_src)
    params, what = _load_base(args, tokenizer)
    params = for_backend(params)
    suffix_len = args.suffix_len or _longest_suffix(train_src, tokenizer, prompt, label_key)
    lr = args.lr if args.lr is not None else (1e-3 if base_mode else 3e-3)
    config = TrainConfig(
        mode=args.mode, prompt=prompt, label_key=label_key, steps=args.steps, batch_size=args.batch_size,
        suffix_len=suffix_len, rank=args.rank, alpha=args.alpha, targets=tuple(args.targets.split(",")),
        peak_lr=lr, final_lr=args.final_lr if args.final_lr is not None else lr / 30, warmup_steps=args.warmup,
        weight_decay=args.weight_decay, clip_norm=args.clip_norm, seed=args.seed, augment=args.augment,
    )
    task = TextTask(robot=_robot(args.prompt_len), tokenizer=tokenizer, prompt=prompt, label_key=label_key,
                    suffix_len=suffix_len)
    tok_file.write_bytes(tokenizer.to_bytes())
    run = {"argv": argv, "base": what, "data": str(args.data.resolve()),
           "train_frames": len(train_src), "eval_frames": len(eval_src) if eval_src is not None else 0,
           "tokenizer_vocab": tokenizer.vocab_size, "prompt_len": args.prompt_len, "config": config.to_json(),
           "model": checkpoint_config_json(params.config), "devices": args.devices or jax.device_count()}
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    print(f"{args.mode}: {what}; {len(train_src)} train / {len(eval_src) if eval_src else 0} eval frames; "
          f"task {prompt!r} -> {label_key!r}, T={suffix_len}; {jax.device_count()} device(s)", flush=True)
    digest_before = None if base_mode else tree_digest(params)  # base mode trains these leaves
    with open(out / "metrics.jsonl", "a") as metrics_file:
        def log(entry):
            metrics_file.write(json.dumps(entry) + "\n")
            metrics_file.flush()
            if entry["event"] != "train":
                print(json.dumps(entry), flush=True)

        result = train(config, params, task, train_src, eval_source=eval_src, eval_every=args.eval_every,
                       eval_frames=args.eval_frames, checkpoint_dir=out / "checkpoints",
                       checkpoint_every=args.checkpoint_every, stop_at=args.stop_at, mesh=make_mesh(args.devices),
                       progress=not args.no_progress, log=log)
    if not base_mode:  # the frozen base, checked rather than assumed
        unchanged = tree_digest(params) == digest_before
        with open(out / "metrics.jsonl", "a") as metrics_file:
            metrics_file.write(json.dumps({"event": "base_check", "base_leaves_bit_identical": unchanged}) + "\n")
        print(f"base leaves bit-identical after training: {unchanged}")
    if int(result.state.step) < config.steps:
        print(f"stopped at step {int(result.state.step)} of {config.steps}; rerun the same command to resume")
        return 0
    if base_mode:
        final = with_base_trainable(params, jax.device_get(result.state.trainable))
        dest = checkpoint.save_params(out / "base", final, overwrite=True)
    else:
        adapter = jax.device_get(result.state.trainable).adapter(1)
        dest = save_adapter(out / "adapter", adapter, name=DEFAULT_ADAPTER_NAME, prompt=prompt, base=args.base,
                            extra={"label_key": label_key, "suffix_len": suffix_len, "prompt_len": args.prompt_len,
                                   "steps": config.steps}, overwrite=True)
    evals = [h for h in result.history if h["event"] == "eval"]
    print(f"saved {dest}" + (f"; held-out greedy exact match {evals[-1]['exact_match']:.3f}" if evals else ""))
    return 0


def _longest_suffix(source, tokenizer: Tokenizer, prompt: str, label_key: str) -> int:
    labels = {str(f[label_key]) for f in frame_texts(source, (label_key,))}
    return len(encode_suffix_prompt(tokenizer, prompt)) + max(len(tokenizer.encode(x)) for x in labels) + 1


# -------------------------------------------------------------------------------------------------
# The embedded demo: base + adapter + tokenizer + a few held-out frames in one folder
# -------------------------------------------------------------------------------------------------

DEMO_DIR = Path(__file__).resolve().parents[1] / "checkpoints" / "demo"
DEMO_MANIFEST = "demo.json"


@dataclasses.dataclass(frozen=True)
class Demo:
    """What `load_demo` returns.

    Attributes:
      params: the base model (`params.for_backend` form); config: its `ModelConfig`.
      tokenizer: the demo's SentencePiece model; robot: `robot_config("libero", max_token_len=prompt_len)`.
      bank, adapter_names: `Engine(params, cfg, tokenizer, bank=bank, adapter_names=adapter_names)`.
      prompt: the adapter's request prompt ("Memory: "); max_new_tokens: enough for every label + EOS.
      frames: held-out LIBERO frames (dicts: image / wrist_image uint8 [Px, Px, 3], state float32 [8],
        language_instruction, memory (the true label), scene, task, init_index, frame_key, predicted).
      manifest: demo.json.
    """

    params: Params
    config: ModelConfig
    tokenizer: Tokenizer
    robot: RobotConfig
    bank: lora.LoraBank
    adapter_names: tuple[str, ...]
    prompt: str
    max_new_tokens: int
    frames: list[dict]
    manifest: dict

    def samples(self) -> list[dict]:
        """The frames as openpi LIBERO client samples (`transforms.make_observation` input)."""
        return [{"observation/image": f["image"], "observation/wrist_image": f["wrist_image"],
                 "observation/state": f["state"], "prompt": f["language_instruction"]} for f in self.frames]


def load_demo(path: str | os.PathLike = DEMO_DIR) -> Demo:
    """Loads the embedded demo folder (default `checkpoints/demo`): checksummed base, adapter, tokenizer, frames."""
    from PIL import Image

    from oxygen_jax.ckpts import checkpoint
    from oxygen_jax.models.pi05.params import for_backend

    root = Path(path).expanduser().resolve()
    manifest_file = root / DEMO_MANIFEST
    if not manifest_file.is_file():
        raise FileNotFoundError(f"{root} is not a demo folder (no {DEMO_MANIFEST}); see checkpoints/demo/README.md")
    manifest = json.loads(manifest_file.read_text())
    config, params = checkpoint.restore_params(root / manifest["base"])
    tokenizer = Tokenizer.from_file(root / manifest["tokenizer"])
    bank, names = load_bank([root / manifest["adapter"]], config, base=root / manifest["base"])
    frames = []
    for row in json.loads((root / manifest["frames"]).read_text()):
        frame = dict(row)
        for key in ("image", "wrist_image"):
            frame[key] = np.asarray(Image.open(root / "frames" / row[key]).convert("RGB"))
        frame["state"] = np.asarray(row["state"], np.float32)
        frames.append(frame)
    return Demo(params=for_backend(params), config=config, tokenizer=tokenizer,
                robot=robot_config("libero", max_token_len=manifest["prompt_len"]), bank=bank, adapter_names=names,
                prompt=manifest["prompt"], max_new_tokens=manifest["max_new_tokens"], frames=frames, manifest=manifest)


def _pick_frames(source: Sequence[Mapping], n: int, seed: int = 0) -> list[int]:
    """n frame indices covering as many (task, label) pairs as possible, round-robin over tasks."""
    by_task: dict[str, dict[str, list[int]]] = {}
    for i, f in enumerate(frame_texts(source, ("language_instruction", "memory"))):
        by_task.setdefault(str(f["language_instruction"]), {}).setdefault(str(f["memory"]), []).append(i)
    rng = np.random.default_rng(seed)
    queues = {t: [rng.choice(ix) for _, ix in sorted(labels.items())] for t, labels in sorted(by_task.items())}
    for q in queues.values():
        rng.shuffle(q)
    picked: list[int] = []
    while len(picked) < n and any(queues.values()):
        for q in queues.values():
            if q and len(picked) < n:
                picked.append(int(q.pop()))
    return picked


def export_demo(base: str | os.PathLike, adapter: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike,
                *, split: str = "heldout", num_frames: int = 8, evaluation: Mapping | None = None) -> Path:
    """Assembles a demo folder: `base/` (copy of a save_params dir), `memory_adapter/`, `tokenizer.model`
    (from beside the adapter's run), `frames/` (PNG of both cameras + frames.json with true labels and the
    demo's own greedy answers) and `demo.json`."""
    import shutil

    from PIL import Image

    from oxygen_jax.ckpts import checkpoint
    from oxygen_jax.models.pi05.params import for_backend
    from training.memory_data import open_memory_dataset

    base, adapter, out = Path(base).resolve(), Path(adapter).resolve(), Path(out).resolve()
    tok_file = adapter.parent / "tokenizer.model"
    run = json.loads((adapter.parent / "run.json").read_text())
    extra = json.loads((adapter / "adapter.json").read_text()).get("extra", {})
    if out.exists():
        shutil.rmtree(out)
    (out / "frames").mkdir(parents=True)
    shutil.copytree(base, out / "base")
    shutil.copytree(adapter, out / "memory_adapter")
    meta = json.loads((out / "memory_adapter" / "adapter.json").read_text())
    meta["base"] = "../base"  # relative: the folder moves with the repository (the fingerprint identifies it)
    (out / "memory_adapter" / "adapter.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.copyfile(tok_file, out / "tokenizer.model")

    source = open_memory_dataset(data, split)
    picked = _pick_frames(source, num_frames)
    config, params = checkpoint.restore_params(out / "base")
    params = for_backend(params)
    tokenizer = Tokenizer.from_file(out / "tokenizer.model")
    bank, _ = load_bank([out / "memory_adapter"], config, base=out / "base")
    task = TextTask(robot=robot_config("libero", max_token_len=run["prompt_len"]), tokenizer=tokenizer,
                    prompt=meta["prompt"], label_key=extra.get("label_key", "memory"),
                    suffix_len=extra.get("suffix_len", run["config"]["suffix_len"]))
    frames = [source[i] for i in picked]
    answers = engine_answers(params, task, fixed_batches(frames, task, config, len(frames)), bank=bank,
                             adapter=DEFAULT_ADAPTER_NAME)
    rows = []
    for k, (f, answer) in enumerate(zip(frames, answers.texts)):
        row = {key: f[key] for key in ("language_instruction", "memory", "scene", "task", "init_index", "frame_key")
               if key in f}
        for key in ("image", "wrist_image"):
            name = f"{k:02d}_{key}.png"
            Image.fromarray(np.asarray(f[key])).save(out / "frames" / name, optimize=True)
            row[key] = name
        row["state"] = [float(x) for x in np.asarray(f["state"])]
        row["predicted"] = answer
        rows.append(row)
    (out / "frames" / "frames.json").write_text(json.dumps(rows, indent=1) + "\n")
    manifest = {
        "base": "base", "adapter": "memory_adapter", "tokenizer": "tokenizer.model", "frames": "frames/frames.json",
        "adapter_name": meta["name"], "prompt": meta["prompt"], "robot": "libero", "prompt_len": run["prompt_len"],
        "max_new_tokens": task.suffix_len - len(task.prompt_ids), "tokenizer_vocab": tokenizer.vocab_size,
        "data": str(Path(data).resolve()), "frames_split": split, "actions": "random: the action expert was never trained",
        **({"evaluation": dict(evaluation)} if evaluation else {}),
    }
    (out / DEMO_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def _export_main(argv: Sequence[str]) -> int:
    p = OneLineParser(prog="python -m training.memory_lora export-demo",
                      description="Assemble the embedded demo folder from a base run and an adapter run.")
    p.add_argument("--base", type=Path, required=True, help="the base run's base/ (checkpoint.save_params dir)")
    p.add_argument("--adapter", type=Path, required=True, help="the adapter run's adapter/ (tokenizer.model beside it)")
    p.add_argument("--data", type=Path, required=True, help="memory dataset the frames are taken from")
    p.add_argument("--split", default="heldout")
    p.add_argument("--frames", type=int_at_least(1), default=8, help="held-out frames to include (PNG, both cameras)")
    p.add_argument("--eval-json", type=existing("file"), default=None,
                   help="eval.memory_eval's memory_eval.json to summarise (its memory_eval.md is copied too)")
    p.add_argument("--out", type=Path, default=DEMO_DIR)
    args = p.parse_args(argv)
    evaluation = None
    if args.eval_json is not None:
        r = json.loads(args.eval_json.read_text())
        evaluation = {k: r[k] for k in ("n", "exact_match", "token_accuracy", "majority_label", "majority_baseline",
                                        "per_task_majority_baseline", "per_task_oracle_constant", "base_exact_match",
                                        "action_max_abs_diff", "per_instruction", "train_frames", "train_layouts")
                      if k in r}
    out = export_demo(args.base, args.adapter, args.data, args.out, split=args.split, num_frames=args.frames,
                      evaluation=evaluation)
    if args.eval_json is not None and (args.eval_json.parent / "memory_eval.md").is_file():
        import shutil

        shutil.copyfile(args.eval_json.parent / "memory_eval.md", out / "memory_eval.md")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
