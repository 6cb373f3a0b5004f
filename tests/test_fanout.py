"""Fan-out: several action heads and the language decoder on one shared prefix, in one compiled frame program.

One tiny Qwen3-VL model (images, DeepStack, M-RoPE) with XR0-, QwenPI_v3- and GR00T-style heads and a language
decoder; three prompt rows (those of tests/test_mot.py: unpadded, left-padded, junk under the mask). The
specification:

* each head's actions from the fan-out frame (`runtime.frame.frame_step`) are bit-identical to that head run alone
  with its own prefix pass (`mot.sample_all` of the single-head model), in frames with and without language;
* the language tokens are those of one request decoded alone from the same prefix, and those of a cache-free
  recompute (a full forward per token);
* the four settings give the same actions and the same greedy tokens;
* a 20-frame run with changing arrivals and cancellations compiles the frame program once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mot_prompt_rows

from oxygen_jax.models import backbone as bb
from oxygen_jax.runtime import decode
from oxygen_jax.models import mot
from oxygen_jax.runtime import frame as schedule
from oxygen_jax.models.vla import MultiHead

_ROWS, _MASK = mot_prompt_rows()  # same shapes in test_mot and test_fanout: compiled programs are shared
N, K, SLOTS = 6, 2, 3  # tokens per request, tokens per frame, decode slots


def _images(rng) -> list[np.ndarray]:
    return [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(3)]


@pytest.fixture(scope="module")
def tiny():
    spec = mot.preset("tiny")
    params = mot.init_model(spec, seed=0)
    rng = np.random.default_rng(0)
    inputs = mot.make_inputs(spec, _ROWS, _MASK, _images(rng))
    noises = {h.name: jnp.asarray(rng.standard_normal((3, h.horizon, h.action_dim)), jnp.float32) for h in spec.heads}
    states = {h.name: jnp.asarray(rng.standard_normal((3, h.state_dim)), jnp.float32)
              for h in spec.heads if h.state_dim}
    lm = mot.language_model(spec, params)
    # Frame 0 admits one request per row, frames 1.. have none (the same compiled program); the requests emit
    # 1 + 2, 2, 1 tokens in frames 0-2, so frame 3 has no language work.
    pool = decode.init_pool(lm, SLOTS, inputs.input_ids.shape[1], N)
    frames = []
    for f in range(4):
        req = decode.make_requests(2, 0, [0, 1] if f == 0 else [], rows=[0, 1] if f == 0 else None,
                                   budgets=[N, N] if f == 0 else [], stop_ids=[-1, -1] if f == 0 else None)
        pool, out = schedule.frame_step(MultiHead(params, spec), pool, inputs, noises, req, np.zeros(SLOTS, bool),
                                        None, states, tokens_per_frame=K)
        frames.append(jax.device_get(out))
    tokens = {}
    for out in frames:
        for slot, rid in enumerate(out.request_id):
            if rid >= 0:
                tokens.setdefault(int(rid), []).extend(int(t) for t in out.new_tokens[slot] if t >= 0)
    return dict(spec=spec, params=params, inputs=inputs, noises=noises, states=states, lm=lm, frames=frames,
                tokens=tokens)


def _one_request(row: int) -> decode.Requests:
    """Request `row` alone (id = row), greedy, exactly N tokens."""
    return decode.make_requests(1, 0, [row], rows=[row], budgets=[N], stop_ids=[-1])


def test_each_heads_actions_are_bit_identical_to_that_head_alone_with_and_without_language(tiny):
    """Frame 0 admits two requests and decodes, frame 3 has no language work left: in both, every head's actions
    equal the single-head model's (its own prefix pass keeping only its reads), bit for bit."""
    spec, params = tiny["spec"], tiny["params"]
    with_text, without = tiny["frames"][0], tiny["frames"][3]
    assert with_text.batch == 2 and without.batch == 0 and (without.new_tokens < 0).all()
    for name in spec.names:
        alone = schedule.head_program(MultiHead(params, spec), name, tiny["inputs"], tiny["noises"], tiny["states"])
        np.testing.assert_array_equal(with_text.actions[name], alone, err_msg=name)
        np.testing.assert_array_equal(without.actions[name], alone, err_msg=name)
        assert alone.shape == (3, spec.head(name).horizon, spec.head(name).action_dim)
        assert not np.allclose(alone[0], alone[1], atol=1e-3)  # the rows really differ


def _recompute_greedy(spec, params, n):
    """Greedy tokens of rows 0 and 1 by a full forward over [prompt | generated] per token (no cache).

    The generated tokens are appended after the prompt, masked until written, so one compiled program serves
    every step; M-RoPE positions of appended text continue at the row's max position + 1 (make_inputs)."""
    p = _ROWS.shape[1]
    rows, mask = np.zeros((3, p + n), np.int32), np.zeros((3, p + n), bool)
    rows[:, :p], mask[:, :p] = _ROWS, _MASK
    images = _images(np.random.default_rng(0))
    text = spec.only(language=True)
    logits = jax.jit(lambda p, i: bb.lm_logits(spec.backbone, p.decoder, mot.prefix_pass(text, p, i).last_hidden))
    for j in range(n):
        token = np.argmax(np.asarray(logits(params, mot.make_inputs(spec, rows, mask, images))), -1)
        rows[:, p + j], mask[:, p + j] = token, True
    return rows[:2, p:].tolist()


def test_language_tokens_equal_a_single_request_decode_and_a_cache_free_recompute(tiny):
    """Tokens emitted across frames (1 + 2 + 2 + 1) by the fan-out frame = each request decoded alone (its own
    language-only prefix pass, a pool of one slot: `text_program`) = greedy argmax of a full forward per token."""
    spec, params, inputs = tiny["spec"], tiny["params"], tiny["inputs"]
    alone = [np.asarray(schedule.text_program(MultiHead(params, spec), inputs, _one_request(row),
                                              max_new_tokens=N)[0][0]).tolist() for row in (0, 1)]
    assert [tiny["tokens"][0], tiny["tokens"][1]] == alone == _recompute_greedy(spec, params, N)
    assert all(len(set(t)) > 2 for t in alone)  # meaningful sequences, not one repeated token


def test_four_settings_give_the_same_actions_and_greedy_tokens(tiny):
    """The left-padded row's request in every setting; the actions of both rows."""
    spec, params, inputs, req = tiny["spec"], tiny["params"], tiny["inputs"], _one_request(1)
    noises, states = tiny["noises"], tiny["states"]
    vla = MultiHead(params, spec)
    iso = schedule.run_isolated(vla, inputs, noises, req, None, states, max_new_tokens=N)
    par = schedule.run_parallel(vla, inputs, noises, req, None, states, max_new_tokens=N)
    shared = schedule.shared_kv_program(vla, inputs, noises, req, None, states, max_new_tokens=N)
    continuous = tiny["frames"][0].actions, [tiny["tokens"][1]]
    for actions, tokens in [(iso[0], iso[1]), (par[0], par[1]), (shared[0], shared[1]), continuous]:
        assert set(actions) == set(spec.names)
        for name in spec.names:
            np.testing.assert_array_equal(actions[name], continuous[0][name], err_msg=name)
        assert np.asarray(tokens).tolist() == continuous[1]
    assert np.asarray(iso[2]).tolist() == np.asarray(shared[2]).tolist() == [N]


def test_twenty_frames_with_changing_arrivals_and_cancellations_compile_the_frame_program_once(tiny):
    spec, params, lm = tiny["spec"], tiny["params"], tiny["lm"]
    rng = np.random.default_rng(1)
    pool = decode.init_pool(lm, SLOTS, tiny["inputs"].input_ids.shape[1], N)
    before = schedule.frame_step._cache_size()
    sizes, next_id = [], 0
    for f in range(20):
        inputs = mot.make_inputs(spec, _ROWS, _MASK, _images(rng))
        noises = {n: jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for n, x in tiny["noises"].items()}
        arrivals = int(rng.integers(0, 3))
        ids = list(range(next_id, next_id + arrivals))
        next_id += arrivals
        budgets = [int(rng.integers(1, N + 1)) for _ in ids]
        req = decode.make_requests(2, 0, ids, rows=[i % 2 for i in ids], budgets=budgets, temperatures=[0.7] * arrivals)
        evict = rng.random(SLOTS) < 0.1
        pool, out = schedule.frame_step(MultiHead(params, spec), pool, inputs, noises, req, evict, None, tiny["states"],
                                        tokens_per_frame=K)
        assert all(np.isfinite(a).all() for a in jax.device_get(out.actions).values())
        sizes.append(schedule.frame_step._cache_size())
    assert sizes == [sizes[0]] * 20 and sizes[0] - before <= 1
    assert next_id > 10  # requests did arrive, queue-free or not, through one program
