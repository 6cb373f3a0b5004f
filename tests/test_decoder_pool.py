"""One slot-pool specification, run for every language-decoder kind (`models.decoder.LanguageDecoder`).

The pool (`runtime.decode`) knows only the interface; each kind must give it the same guarantees:

* admission + greedy decoding in the pool yields the tokens of a full forward recompute of
  [prefix | request prompt | generated] (no cache), request by request;
* a slot reused after its request was released keeps nothing of that request: the next request decodes
  the tokens it decodes in a fresh pool;
* a free or finished slot steps as the identity: its K/V and carry come back bit for bit.

Kinds: Gemma (π0.5's VLM expert, `Observation` inputs, causal prompt so that the full recompute can append
tokens to the prompt), Qwen3-VL (`AttentionDecoder` on token inputs) and Qwen3.5 (`HybridDecoder`, whose
carry is each linear layer's conv window and recurrent state). A test checks that every subclass of
`LanguageDecoder` is covered, so a new kind joins this file.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import diverse_text_params, make_obs
from oxygen_jax.models import mot
from oxygen_jax.models.decoder import LanguageDecoder
from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.models.vla import MultiHead
from oxygen_jax.runtime import decode

P, Q, M, NS = 10, 3, 5, 3  # prefix tokens (token kinds), request-prompt capacity, new tokens, slots (one
# pool shape throughout: each kind compiles admission and the decode step once)


@dataclasses.dataclass
class _Kind:
    """A language-only model and a way to write extra tokens after each row's prefix (the full recompute)."""

    vla: MultiHead
    inputs: object  # the batch-2 prefix inputs
    lengths: list[int]  # valid prefix tokens per row (where appended tokens go)
    extend: object  # (row, tokens) -> inputs of one row with `tokens` after its prefix, fixed shapes


def _gemma(tiny_params) -> _Kind:
    params = diverse_text_params(tiny_params).with_config(prompt_attention="causal")
    obs = make_obs(params.config, batch=2, cameras=2, prompt_len=7 + Q + M, lengths=[5, 7])

    def extend(row, tokens):
        toks = np.array(obs.tokens[row:row + 1])
        toks[0, [5, 7][row]:[5, 7][row] + len(tokens)] = tokens
        return dataclasses.replace(obs, images=obs.images[row:row + 1], image_masks=obs.image_masks[row:row + 1],
                                   tokens=jnp.asarray(toks), token_mask=jnp.asarray(np.arange(toks.shape[1])[None]
                                                                                   < [5, 7][row] + len(tokens)))
    return _Kind(as_vla(params).without_heads(), obs, [5, 7], extend)


def _tokens_kind(spec: mot.ModelSpec, seed: int) -> _Kind:
    """Left-padded text rows of P tokens (rows of 10 and 7); the recompute writes after them (right padding)."""
    spec = spec.only(language=True)
    vla = MultiHead(mot.init_model(spec, seed), spec)
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, 400, (2, P)).astype(np.int32)
    mask = np.arange(P)[None] >= np.array([0, 3])[:, None]

    def extend(row, tokens):
        full = np.zeros((1, P + Q + M), np.int32)
        full[0, :P] = ids[row]
        full[0, P:P + len(tokens)] = tokens
        valid = np.zeros((1, P + Q + M), bool)
        valid[0, :P] = mask[row]
        valid[0, P:P + len(tokens)] = True
        return mot.make_inputs(spec, full, valid)
    return _Kind(vla, mot.make_inputs(spec, ids, mask), [10, 7], extend)


_KINDS = {"gemma": lambda tp: _gemma(tp), "qwen3vl": lambda tp: _tokens_kind(mot.preset("tiny"), 1),
          "qwen35": lambda tp: _tokens_kind(mot.preset("qwen35_tiny"), 2)}


@pytest.fixture(scope="module", params=sorted(_KINDS))
def kind(request, tiny_params):
    k = _KINDS[request.param](tiny_params)
    return k, k.vla.language(), jax.jit(lambda vla, inputs: vla.prefix(inputs))(k.vla, k.inputs)


@jax.jit
def _next_logits(vla: MultiHead, inputs):
    """Greedy reference: the logits after the last valid token of one row, from a prefix pass with no cache."""
    lm = vla.language()
    rows = lm.rows(vla.prefix(inputs), jnp.zeros(1, jnp.int32))
    return lm.logits_vocab_major(rows.last_hidden)[:, 0]


def _recompute(k: _Kind, row: int, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(np.asarray(_next_logits(k.vla, k.extend(row, seq))))))
    return seq[len(prompt):]


def _requests(rids, rows, prompts, budgets):
    return decode.make_requests(NS, Q, rids, rows=rows, prompts=prompts, budgets=budgets, stop_ids=[-1] * len(rids))


def _pool(lm, prefix):
    return decode.init_pool(lm, NS, decode.prefix_length(prefix), M, Q)


def _to_completion(lm, pool):
    for _ in range(M):
        pool, _, _ = decode.decode_step(lm, pool)
    return pool


def _tokens(pool, slot) -> list[int]:
    return [int(t) for t in np.asarray(pool.tokens[slot]) if t >= 0]


def _alone(lm, prefix, row, prompt, budget) -> list[int]:
    pool, _, _ = decode.admit(lm, _pool(lm, prefix), prefix, _requests([0], [row], [prompt], [budget]))
    return _tokens(_to_completion(lm, pool), 0)


def test_every_decoder_kind_is_covered_here(tiny_params):
    covered = {type(_KINDS[name](tiny_params).vla.language()) for name in _KINDS}

    def subclasses(cls):
        return {s for c in cls.__subclasses__() for s in {c} | subclasses(c)}
    assert subclasses(LanguageDecoder) <= covered, f"decoder kinds without the shared pool test: {subclasses(LanguageDecoder) - covered}"


def test_pool_greedy_tokens_equal_a_full_forward_recompute(kind):
    k, lm, prefix = kind
    prompts = [[11, 12], [40, 41, 42]]
    pool, _, _ = decode.admit(lm, _pool(lm, prefix), prefix, _requests([0, 1], [0, 1], prompts, [M, M]))
    pool = _to_completion(lm, pool)
    for slot, prompt in enumerate(prompts):
        assert _tokens(pool, slot) == _recompute(k, slot, prompt, M), slot
    assert len(set(_tokens(pool, 0) + _tokens(pool, 1))) > 2  # not one repeated token


def test_a_reused_slot_keeps_nothing_of_its_previous_request(kind):
    _, lm, prefix = kind
    pool = _pool(lm, prefix)
    pool, _, _ = decode.admit(lm, pool, prefix, _requests([7, 9, 10], [1, 0, 1], [[40, 41, 42], [5], []], [M, M, M]))
    pool = _to_completion(lm, pool)
    pool, released = decode.release_finished(pool)
    assert bool(released.done[0]) and not bool(pool.occupied.any())
    pool, _, _ = decode.admit(lm, pool, prefix, _requests([8], [0], [[11]], [3]))
    assert int(pool.request_id[0]) == 8  # the slot request 7 was released from
    assert _tokens(_to_completion(lm, pool), 0) == _alone(lm, prefix, 0, [11], 3)


def test_free_and_finished_slots_step_as_the_identity(kind):
    _, lm, prefix = kind
    # slot 0 decodes on; slot 1 finishes after one token and stays in the pool; slot 2 was never used
    pool, _, _ = decode.admit(lm, _pool(lm, prefix), prefix, _requests([0, 1], [0, 1], [[11], [40]], [M, 1]))
    pool, _, _ = decode.decode_step(lm, pool)
    assert bool(pool.active[0]) and not bool(pool.active[1]) and not bool(pool.occupied[2])
    before = jax.tree.map(np.asarray, (pool.k, pool.v, pool.carry))
    pool, _, _ = decode.decode_step(lm, pool)
    after = jax.tree.map(np.asarray, (pool.k, pool.v, pool.carry))
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(new[:, 1:], old[:, 1:])  # leaves are [layers, Ns, ...]
    assert any(np.any(new[:, 0] != old[:, 0]) for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
