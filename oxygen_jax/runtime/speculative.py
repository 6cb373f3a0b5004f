"""Exact speculative decoding on the slot pool: drafts from arrays, one verify pass per step, no second model.

Axes (`oxygen_jax.axes`): Ns slots, M max new tokens, R draft reference width (`decode.draft_capacity`),
γ draft tokens per step (static, `DecodePool.draft_len`), T = γ + 1 block entries, C slot length, V vocabulary.

**Drafts.** Each slot keeps a reference `draft_ref` [Ns, R] written at admission (`runtime.draft_book`: the
same robot's previous answer to the same prompt and adapter, then its recent answers, then the prompt,
segments separated by -1). Before every verify step a slot drafts up to γ tokens on the device:

  (a) when the tokens generated so far equal the start of the previous answer (segment 0), the answer's
      next tokens;
  (b) else an n-gram lookup: the first place in the reference, then in the slot's own generated tokens,
      where its last two tokens (one at the first step) occur, and the tokens that follow there.

A draft stops at a segment end and at `budget - generated - 1` tokens (never past `max_tokens`).

**Verification.** One pass of the decoder (`LanguageDecoder.verify`) scores the block [pending token |
draft] of every slot, causal inside the block, over the slot's K/V:

    block entry i   0         1     ...  γ          (entries past a slot's draft length: invalid)
    fed token       pending   d_0   ...  d_{γ-1}
    scores token    g         g+1   ...  g+γ        (g = tokens generated so far; key fold_in(key, g + i))

Greedy rows accept the longest prefix of d whose every token is the argmax at its entry, then emit the
argmax after it: exactly the tokens plain greedy decoding emits. Sampled rows use the accept/reject rule
of speculative sampling with the filtered distribution p (temperature, then top-p, as `nn.sampling`)
and a point-mass draft q = δ_d (deterministic drafts): accept d_i with probability min(1, p(d_i) / q(d_i))
= p(d_i); on rejection draw from the residual norm(max(0, p - q)) = p without d_i, renormalised; after a
fully accepted draft draw from p. Each emitted token is thus distributed as p, as in plain sampling.

**What a burst returns.** Emitted tokens in order, -1 where nothing was emitted, and `REJECTED` (-2) at
the draft entries a verify step fed but did not emit: a host that reads only ids >= 0 sees the tokens, and
one that counts also reads the drafts without another transfer (`draft_counts`). Where a stop id inside the
accepted draft ended a block, its every emitted token was a draft and the model's own token never came: the
entry after the stop reads `STOPPED` (-3) instead of `REJECTED`, so the host counts the stop as accepted.

A stop id among the emitted tokens ends the request there. The pool keeps the fed entries up to the last
emitted token's predecessor (the last emitted token is the next pending one), so K/V past them are masked
and later overwritten (roll-back by position, no copies); a decoder with a carry leaves it at the last kept
entry (`HybridDecoder.verify`).

**Budget.** A frame's k (`num_steps`) counts decode-step equivalents: a verify step in which some slot drafts
costs the pool's static `verify_cost` (about 1 where a decode step is bound by reading weights and K/V, as on a
GPU; the measured verify / decode ratio on a compute-bound CPU), a step without drafts costs 1 and runs as a
plain decode step. One compile per (γ, k, cost).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models.decoder import LanguageDecoder, row_adapters
from oxygen_jax.runtime import slot_mesh
from oxygen_jax.runtime.decode import DecodePool, Sampling

_NGRAM = 2  # the n of lookup (b)
REJECTED = -2  # a burst entry: a draft token fed to a verify step and not emitted
STOPPED = -3  # a burst entry: where a stop id inside the accepted draft left the model's own token undrawn
DRAFTER = "lookup: the robot's previous answer, then n-grams of its references (no draft model)"
"""What proposes the drafts, for a server's start-up line, metadata and /healthz."""
_SLACK = 1e-4  # float tolerance of the budget test (costs are sums of a few decimals)


def _first_true(x: jax.Array) -> jax.Array:
    """Index of the first True along the last axis, or its length where there is none."""
    n = x.shape[-1]
    if n == 0:
        return jnp.zeros(x.shape[:-1], jnp.int32)
    return jnp.min(jnp.where(x, jnp.arange(n), n), axis=-1)


def _continuation(source: jax.Array, start: jax.Array, gamma: int) -> tuple[jax.Array, jax.Array]:
    """source [Ns, X] tokens from `start` [Ns] on, up to γ and to the first -1: (draft [Ns, γ] (0 past its
    length), length [Ns])."""
    idx = start[:, None] + jnp.arange(gamma)[None, :]
    toks = jnp.take_along_axis(source, jnp.minimum(idx, source.shape[1] - 1), axis=1)
    ok = (idx < source.shape[1]) & (toks >= 0)
    n = _first_true(~ok)
    return jnp.where(jnp.arange(gamma)[None, :] < n[:, None], toks, 0), n


def _ngram_start(source: jax.Array, context: jax.Array, n: jax.Array, limit: jax.Array) -> jax.Array:
    """Where in source [Ns, X] the first occurrence of the last n (1 or 2) context [Ns, 2] tokens ends, plus one,
    among ends before `limit` [Ns]; X where there is none."""
    x = source.shape[1]
    j = jnp.arange(x)[None, :]
    last = source == context[:, 1:2]
    prev = jnp.concatenate([jnp.full_like(source[:, :1], -2), source[:, :-1]], axis=1) == context[:, 0:1]
    hit = last & ((n[:, None] < 2) | prev) & (j + 1 < limit[:, None])
    return jnp.minimum(_first_true(hit) + 1, x)


def propose(pool: DecodePool) -> tuple[jax.Array, jax.Array]:
    """Every slot's draft for its next verify step: (tokens int32 [Ns, γ], length int32 [Ns]); lengths are 0 for
    inactive slots and at most budget - generated - 1."""
    gamma, ref, toks, g = pool.draft_len, pool.draft_ref, pool.tokens, pool.num_generated
    m, r = toks.shape[1], ref.shape[1]
    # (a) the previous answer (segment 0 of the reference), continued where the slot stands
    seg0 = _first_true(ref < 0)
    agrees = jnp.all((toks == ref[:, :m]) | (jnp.arange(m)[None, :] >= g[:, None]), axis=1)  # R > M
    draft_a, len_a = _continuation(ref, g, gamma)
    len_a = jnp.where(agrees & (g < seg0), len_a, 0)
    # (b) the last tokens looked up in the reference, then in the slot's own tokens before them
    n = jnp.minimum(g, _NGRAM)
    context = jnp.take_along_axis(toks, jnp.maximum(g[:, None] - jnp.array([2, 1]), 0), axis=1)
    at_ref = _ngram_start(ref, context, n, jnp.full_like(g, r))
    draft_r, len_r = _continuation(ref, at_ref, gamma)
    at_own = _ngram_start(toks, context, n, g)
    draft_o, len_o = _continuation(jnp.where(jnp.arange(m)[None, :] < g[:, None], toks, -1), at_own, gamma)
    use_r = len_r > 0
    draft_b, len_b = jnp.where(use_r[:, None], draft_r, draft_o), jnp.where(use_r, len_r, len_o)
    use_a = len_a > 0
    draft = jnp.where(use_a[:, None], draft_a, draft_b)
    length = jnp.where(use_a, len_a, len_b)
    length = jnp.where(pool.active, jnp.clip(length, 0, pool.sampling.budget - g - 1), 0)
    return draft, length.astype(jnp.int32)


def _nucleus(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """The distribution plain sampling draws from: softmax of logits [n, V] / t over the smallest set of tokens
    whose mass reaches top_p (the mass strictly above a kept token is below top_p; top_p = 1 keeps all)."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    above = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = (above < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def _judge(logits: jax.Array, draft: jax.Array, length: jax.Array, sampling: Sampling, generated: jax.Array):
    """Accept / reject per block entry: (accept bool [Ns, γ], token int32 [Ns, T]: what entry i emits when the
    draft is rejected there or ends before it). logits: vocabulary-major float32 [V, Ns T] (greedy rows read
    them in place; only sampled rows pay for the transpose)."""
    ns, t = draft.shape[0], draft.shape[1] + 1
    v = logits.shape[0]
    greedy = jnp.argmax(logits, axis=0).astype(jnp.int32).reshape(ns, t)
    stochastic = sampling.temperature > 0
    drafted = jnp.concatenate([draft, jnp.zeros((ns, 1), jnp.int32)], axis=1)  # [Ns, T]: entry γ has no draft
    has_draft = jnp.arange(t)[None, :] < length[:, None]

    def draw(_):
        flat = lambda a: jnp.repeat(a, t, axis=0)  # noqa: E731 - per slot -> per entry
        p = _nucleus(logits.T, flat(sampling.temperature), flat(sampling.top_p)).reshape(ns, t, v)
        index = generated[:, None] + jnp.arange(t)[None, :]
        keys = jax.vmap(lambda k, i: jax.vmap(lambda j: jax.random.fold_in(jax.random.wrap_key_data(k), j))(i))(
            sampling.key, index)
        u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1))))(keys)
        p_draft = jnp.take_along_axis(p, drafted[..., None], axis=-1)[..., 0]
        residual = jnp.where(has_draft[..., None] & (jnp.arange(v) == drafted[..., None]), 0.0, p)
        drawn = jax.vmap(jax.vmap(lambda k, r: jax.random.categorical(jax.random.fold_in(k, 2), jnp.log(r))))(keys, residual)
        return u < p_draft, drawn.astype(jnp.int32)

    accept_s, drawn = jax.lax.cond(jnp.any(stochastic), draw, lambda _: (drafted == greedy, greedy), None)
    accept = jnp.where(stochastic[:, None], accept_s, drafted == greedy)[:, :-1]
    token = jnp.where(stochastic[:, None], drawn, greedy)
    return accept, token


def _stops(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """bool [Ns, T]: token [Ns, T] is one of its slot's stop ids [Ns, S]."""
    return jnp.any(tokens[..., None] == stop_ids[:, None, :], axis=-1)


def _verify_block(lm: LanguageDecoder, pool: DecodePool, draft: jax.Array, length: jax.Array, bank=None):
    """Verifies draft [Ns, T - 1] (valid up to `length` [Ns]) after every active slot's pending token: (pool,
    emitted int32 [Ns, T], `REJECTED` at the fed entries past what a slot emitted, -1 past those; `STOPPED` in
    place of the first `REJECTED` where a stop id inside the accepted draft ended the block).

    Example (γ 3, a slot drafting 3 tokens, 1 accepted): [d_0, own, -2, -2]; drafting 0: [own, -1, -1, -1];
    drafting 3, all accepted, d_1 a stop id: [d_0, d_1, -3, -2].
    """
    cap, ns = pool.capacity, pool.num_slots
    t = draft.shape[1] + 1
    act, g = pool.active, pool.num_generated
    block = jnp.concatenate([pool.last_token[:, None], draft], axis=1)
    entry = jnp.arange(t)[None, :]
    valid = act[:, None] & (entry <= length[:, None])
    write0 = (pool.prefix_len + pool.length)[:, None]
    slots = jnp.arange(cap)[None, None, :]
    attend = pool.mask[:, None, :] | ((slots >= write0[..., None]) & (slots <= (write0 + entry)[..., None]))
    write_index = jnp.where(valid, write0 + entry, cap)
    positions = (pool.base_position + pool.length)[:, None] + entry

    def judge(h):
        logits = lm.logits_vocab_major(lm.final_norm(h).reshape(ns * t, -1))
        accept, token = _judge(logits, draft, length, pool.sampling, g)
        accepted = _first_true(~(accept & (entry[:, :-1] < length[:, None])))  # leading accepted drafts
        own = jnp.take_along_axis(token, accepted[:, None], axis=1)  # the model's token after them
        emitted = jnp.where(entry < accepted[:, None], jnp.concatenate([draft, own], axis=1), own)
        stop = _stops(emitted, pool.sampling.stop_ids) & (entry <= accepted[:, None])
        count = jnp.minimum(_first_true(stop) + 1, accepted + 1)
        keep = jnp.where(act, count, 0)
        return keep, (emitted, keep, jnp.any(stop, axis=1), act & (count <= accepted))

    lm.check_bank(bank)
    (emitted, count, stopped, own_undrawn), (k, v), carry = lm.verify(
        lm.embed(block), positions, valid, attend, pool.k, pool.v, write_index, pool.carry,
        row_adapters(bank, pool.adapter), judge)
    kept = entry < count[:, None]
    rows = jnp.arange(ns)[:, None]
    n = g + count
    last = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    pool = dataclasses.replace(
        pool, k=k, v=v, carry=carry,
        mask=pool.mask.at[rows, jnp.where(kept, write0 + entry, cap)].set(True, mode="drop"),
        length=pool.length + count,
        tokens=pool.tokens.at[rows, jnp.where(kept, g[:, None] + entry, pool.max_new_tokens)].set(emitted, mode="drop"),
        num_generated=n,
        last_token=jnp.where(act, last, pool.last_token),
        active=act & ~stopped & (n < pool.sampling.budget),
    )
    unfed = jnp.where(own_undrawn[:, None] & (entry == count[:, None]), STOPPED, REJECTED)
    return pool, jnp.where(kept, emitted, jnp.where(valid, unfed, -1))


def _budgeted_step(lm: LanguageDecoder, carry, budget: float, bank=None):
    """One step of a frame's language budget. carry: (pool, spent decode-step equivalents float32 []).

    A verify step when some slot drafts and its cost (`pool.verify_cost`) fits in what is left of `budget`; else a
    plain decode step (a [Ns, 1] block, drafts ignored: exact as well) when 1 fits; else nothing. The γ + 1
    query rows are thus paid only where drafts exist. Returns ((pool, spent), emitted int32 [Ns, γ + 1]).
    """
    pool, spent = carry
    draft, length = propose(pool)
    t = pool.draft_len + 1
    live = jnp.any(pool.active)
    verify = live & jnp.any(length > 0) & (spent + pool.verify_cost <= budget + _SLACK)
    plain = live & ~verify & (spent + 1 <= budget + _SLACK)

    def skip(p):
        return p, jnp.full((p.num_slots, t), -1, jnp.int32)

    def single(p):
        p, out = _verify_block(lm, p, draft[:, :0], jnp.zeros_like(length), bank)
        return p, jnp.pad(out, ((0, 0), (0, t - 1)), constant_values=-1)

    branch = jnp.where(verify, 2, jnp.where(plain, 1, 0))
    pool, out = jax.lax.switch(branch, (skip, single, lambda p: _verify_block(lm, p, draft, length, bank)), pool)
    return (pool, spent + jnp.where(verify, pool.verify_cost, jnp.where(plain, 1.0, 0.0))), out


@functools.partial(jax.jit, static_argnames=("num_steps",), donate_argnames=("pool",))
def verify_burst(lm: LanguageDecoder, pool: DecodePool, num_steps: int, bank=None) -> tuple[DecodePool, jax.Array]:
    """Up to `num_steps` verify steps of every active slot in one scan (a speculative pool: `init_pool(...,
    speculate=γ)`). Donates `pool`.

    `num_steps` is the frame's language budget in decode-step equivalents: a step in which no slot drafts costs 1
    (it runs as a decode step), a verify step costs the pool's `verify_cost` (static, >= 1; 1 by default: up to
    `num_steps` verify steps). With `verify_cost` = c > 1 a frame runs at most floor(num_steps / c) verify steps,
    then decode steps while 1 fits: e.g. num_steps 5, c 2.5: two verify steps, or five decode steps when nothing
    drafts (`_budgeted_step`). The budget changes when tokens come, never which tokens.

    Returns:
      (pool, tokens int32 [Ns, num_steps (γ + 1)]: step s emitted columns s (γ + 1) ... in order, `REJECTED`
      at draft entries fed and not emitted, -1 where nothing was fed).
    """
    if pool.draft_len < 1 or pool.draft_ref is None:
        raise ValueError("verify_burst needs a speculative pool: build it with decode.init_pool(..., speculate=γ >= 1)")

    def burst(pool, lm, bank):  # on a meshed pool, every device on its own slots (`slot_mesh.on_slot_devices`)
        (pool, _), toks = jax.lax.scan(lambda c, _: _budgeted_step(lm, c, num_steps, bank), (pool, jnp.float32(0)),
                                       None, length=num_steps)
        return pool, jnp.moveaxis(toks, 0, 1).reshape(pool.num_slots, -1)

    return slot_mesh.on_slot_devices(burst, pool, lm, bank)


def draft_counts(burst: np.ndarray, gamma: int) -> tuple[int, int]:
    """(drafts proposed, drafts accepted) of a burst read on the host (int [Ns, steps (γ + 1)], `verify_burst`).

    Accepted means emitted as drafted: a verify step in which a slot emitted e >= 1 tokens and left r entries
    `REJECTED` accepted e - 1 drafts (its last token is the model's own) and proposed e - 1 + r; with a
    `STOPPED` entry (a stop id inside the draft ended the block, the own token never came) it accepted e and
    proposed e + r. Example (γ 3): [d_0, own, -2, -2]: proposed 3, accepted 1; [d_0, d_1, -3, -2]: proposed
    3, accepted 2; [own, -1, -1, -1]: proposed 0, accepted 0.
    """
    burst = np.asarray(burst)
    emitted = burst >= 0
    own = int(emitted.reshape(burst.shape[0], -1, gamma + 1).any(axis=2).sum()) - int((burst == STOPPED).sum())
    accepted = int(emitted.sum()) - own
    return accepted + int((burst == REJECTED).sum()), accepted
