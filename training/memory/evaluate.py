"""Greedy answers through the real slot pool (`Engine`, one control frame per batch), not teacher forcing,
and the held-out exact match computed from them.

Axes (`oxygen_jax.axes`): B batch rows (one frame of B observations), Ha action horizon, Ad action dims.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.ckpts.adapters import DEFAULT_ADAPTER_NAME
from oxygen_jax.demo import normalize_answer
from oxygen_jax.models import lora
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.pi05.params import Params
from oxygen_jax.robots.tokenizer import Tokenizer
from oxygen_jax.runtime.engine import Engine, EngineConfig
from training.memory.data import MemoryBatch, TextTask, fixed_batches


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
    b = batches[0][0].batch_size
    prompt = task.prompt_ids
    budget = max_new_tokens or max(1, task.suffix_len - len(prompt))
    horizon = task.robot.action_horizon
    engine = Engine(model.as_vla(params, num_steps), EngineConfig(
        num_slots=b, max_new_tokens=budget, prompt_capacity=len(prompt), admissions_per_frame=b, tokens_per_frame=budget,
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
            states = None if batch.state is None else {model.HEAD: jnp.asarray(batch.state)}  # π0's state token
            res = engine.step(obs, noise=noise, states=states)
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


def greedy_exact_match(params: Params, task: TextTask, source: Sequence[Mapping], *, bank=None, batch_size: int = 16,
                       limit: int | None = None) -> float:
    """Held-out greedy exact match (normalised) of `task` answers decoded by the slot pool (adapter id 1 when
    a bank is given)."""
    hits, count = exact_match_hits(params, task, source, bank=bank, batch_size=batch_size, limit=limit)
    return hits / count


def exact_match_hits(params: Params, task: TextTask, source: Sequence[Mapping], *, bank=None, batch_size: int = 16,
                     limit: int | None = None, part: tuple[int, int] = (0, 1)) -> tuple[int, int]:
    """(exact matches, frames judged) of batches part[0], part[0] + part[1], ... of `greedy_exact_match`'s in-order
    batches: part = (process index, process count) splits an evaluation over processes, and the sums of the
    parts are the whole evaluation's (each batch is decoded alone, so its answers do not depend on the split)."""
    index, count = part
    n = len(source) if limit is None else min(limit, len(source))
    starts = list(range(0, n, batch_size))[index::count]
    if not starts:
        return 0, 0
    chunks = [[source[i] for i in range(start, min(start + batch_size, n))] for start in starts]
    batches = [b for frames in chunks for b in fixed_batches(frames, task, params.config, batch_size)]
    out = engine_answers(params, task, batches, bank=bank, adapter="base" if bank is None else DEFAULT_ADAPTER_NAME,
                         num_steps=1)
    refs = [str(f[task.label_key]) for frames in chunks for f in frames]
    return sum(normalize_answer(p) == normalize_answer(r) for p, r in zip(out.texts, refs)), len(refs)
