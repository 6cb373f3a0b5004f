"""Qwen3.5 in the decode slot pool: per-slot conv windows and recurrent states beside the full layers' K/V.

Invariants: `load_model` on an HF Qwen3.5 directory gives a model whose greedy tokens through the pool
equal HF's (../shared/fixtures/qwen35_tiny, skipped when absent); a request decodes the same tokens alone
as in a full pool of mixed-age requests, also in a reused slot; inactive and free slots keep their state
bit for bit; request-prompt padding leaves the state untouched and a request prompt continues the prefix
like one longer prefill; `Engine` steps StarVLA heads on a Qwen3.5 prefix with language requests, each
head's chunk bit-identical to that head alone; `decode.slot_bytes` is the pool's size.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval.bench import harness
from eval.parity import qwen35 as parity
from helpers import FAST_CODEGEN, mot_prompt_rows, shared_dir
from oxygen_jax.ckpts.load import load_model
from oxygen_jax.models.qwen35 import decoder as qwen35_decoder
from oxygen_jax.models.decoder import AttentionDecoder
from oxygen_jax.models import backbone, mot
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.runtime import decode, frame
from oxygen_jax.runtime.engine import Engine, EngineConfig
from oxygen_jax.models.vla import MultiHead

P, Q, M, SLOTS = 12, 3, 8, 4  # prefix length, request-prompt capacity, max new tokens, slots


@pytest.fixture(scope="module")
def tiny():
    """The fixture's dims with random weights; a 3-row left-padded prefix (rows of 12, 9 and 6 tokens)."""
    spec = qwen35.preset("qwen35_tiny")
    dec = qwen35.init_decoder(spec, seed=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 500, (3, P)).astype(np.int32)
    mask = np.arange(P)[None] >= np.array([0, 3, 6])[:, None]
    return spec, dec, ids, mask


_prefix_pass = jax.jit(qwen35.prefix_pass, static_argnums=0, static_argnames=("hidden_layers", "language"))


def _prefix(spec, dec, ids, mask):
    pos = np.where(mask, np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    x = backbone.embed_tokens(spec.backbone, dec, jnp.asarray(ids))
    return _prefix_pass(spec, dec, x, jnp.asarray(pos), jnp.asarray(mask))


@pytest.fixture(scope="module")
def prefix(tiny):
    return _prefix(*tiny)


# (request id, prefix row, request prompt, budget), admitted at the frame given by the schedule below
_REQUESTS = {0: (0, [5, 6], 8), 1: (1, [], 2), 2: (2, [7], 8), 3: (0, [9, 10, 11], 6), 4: (1, [3], 8)}
_SCHEDULE = {0: [0, 1], 1: [2, 3], 2: [4]}  # frame -> requests arriving; request 2 reuses request 1's slot


def _requests(rids, garbage=0):
    rows, prompts, budgets = zip(*(_REQUESTS[r] for r in rids)) if rids else ((), (), ())
    req = decode.make_requests(SLOTS, Q, list(rids), rows=list(rows), prompts=[list(p) for p in prompts], budgets=list(budgets),
                               stop_ids=[-1] * len(rids))
    if garbage:  # fill the padding entries of every prompt: they must not matter
        pad = np.arange(Q)[None] >= req.prompt_len[:, None]
        req = type(req)(**{**vars(req), "prompt": np.where(pad, garbage, req.prompt).astype(np.int32)})
    return req


def _tokens(pool, slot):
    return [int(t) for t in np.asarray(pool.tokens[slot]) if t >= 0]


def _run(lm, prefix, schedule):
    """Frames of admit + 2-token burst + release until every request finished; returns request id -> tokens
    and the slot each used."""
    pool = decode.init_pool(lm, SLOTS, P, M, Q)
    done, slots = {}, {}
    for f in range(8):
        if len(done) == sum(map(len, schedule.values())):
            break
        pool, admitted, _ = decode.admit(lm, pool, prefix, _requests(schedule.get(f, [])))
        for rid, s in zip(np.asarray(pool.request_id).tolist(), range(SLOTS)):
            if rid >= 0:
                slots.setdefault(rid, s)
        pool, _ = decode.decode_burst(lm, pool, 2)
        pool, out = decode.release_finished(pool)
        for s in np.flatnonzero(np.asarray(out.done)):
            done[int(out.request_id[s])] = [int(t) for t in np.asarray(out.tokens[s])[: int(out.num_generated[s])]]
    return done, slots


def test_a_request_decodes_the_same_alone_as_in_a_full_pool_of_mixed_age_requests(tiny, prefix):
    spec, dec, _, _ = tiny
    lm = qwen35_decoder.language_model(spec, dec)
    together, slots = _run(lm, prefix, _SCHEDULE)
    assert sorted(together) == sorted(_REQUESTS)
    assert slots[2] == slots[1]  # request 2 runs in the slot request 1 was released from
    for rid in _REQUESTS:
        alone, _ = _run(lm, prefix, {0: [rid]})
        assert alone[rid] == together[rid], rid
        assert len(together[rid]) == _REQUESTS[rid][2]
    assert len(set(together[0])) > 2  # a meaningful sequence, not one repeated token


def test_inactive_and_free_slots_keep_their_state_bit_for_bit(tiny, prefix):
    spec, dec, _, _ = tiny
    lm = qwen35_decoder.language_model(spec, dec)
    pool = decode.init_pool(lm, SLOTS, P, M, Q)
    pool, _, _ = decode.admit(lm, pool, prefix, _requests([0, 1]))  # request 1 (slot 1) stops after 2 tokens
    pool, _ = decode.decode_burst(lm, pool, 2)
    pool, _ = decode.release_finished(pool)
    assert not bool(pool.occupied[1]) and float(jnp.max(jnp.abs(pool.carry["state"][:, 1]))) > 0  # free, holding a stale state
    before = jax.tree.map(np.asarray, (pool.carry["window"], pool.carry["state"]))
    pool, _ = decode.decode_burst(lm, pool, 2)
    for old, new in zip(before, (pool.carry["window"], pool.carry["state"])):
        np.testing.assert_array_equal(np.asarray(new)[:, 1:], old[:, 1:])  # free slots: unchanged
        assert np.max(np.abs(np.asarray(new)[:, 0] - old[:, 0])) > 0  # the active slot advanced


def test_request_prompt_padding_is_identity_and_a_prompt_continues_the_prefix(tiny, prefix):
    """The prompt's padding entries (any token ids) leave window and state bit-identical; the state after
    a request prompt equals one prefill over [prefix row | prompt]."""
    spec, dec, ids, mask = tiny
    lm = qwen35_decoder.language_model(spec, dec)
    states = []
    for garbage in (0, 77):
        pool = decode.init_pool(lm, SLOTS, P, M, Q)
        pool, _, _ = decode.admit(lm, pool, prefix, _requests([0, 2, 3], garbage))
        states.append(jax.tree.map(np.asarray, (pool.carry["window"], pool.carry["state"])))
    for a, b in zip(*states):
        np.testing.assert_array_equal(a, b)
    row, prompt, _ = _REQUESTS[0]  # prefix row 0 (12 real tokens) + a 2-token prompt
    longer = _prefix(spec, dec, np.concatenate([ids[row], prompt])[None], np.ones((1, P + len(prompt)), bool))
    for ours, ref in zip(states[0], (longer.window, longer.state)):
        np.testing.assert_allclose(ours[:, 0], np.asarray(ref)[:, 0], atol=2e-5 * max(1.0, float(np.max(np.abs(ref)))))


def test_load_model_routes_a_qwen35_directory_and_its_pool_decodes_hfs_greedy_tokens():
    fixture = shared_dir() / "fixtures" / "qwen35_tiny"
    if not fixture.is_dir():
        pytest.skip(f"../shared fixtures not present: {fixture} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    loaded = load_model(fixture, family="multihead")
    spec, dec = loaded.config.hybrid, loaded.params.decoder
    assert loaded.source == "hf" and spec is not None and spec.layer_types.count("full_attention") == 2
    lm = MultiHead(loaded.params, loaded.config).language()
    assert lm.spec == spec and lm.decoder is dec
    with jax.default_matmul_precision("float32"):
        ref = np.load(fixture / "reference.npz")
        rows = ref["gen_rows"]
        ids, am = ref["input_ids"][rows], ref["attention_mask"][rows].astype(bool)
        positions = np.where(am, np.cumsum(am, -1) - 1, 0).astype(np.int32)
        x = backbone.embed_tokens(spec.backbone, dec, jnp.asarray(ids))
        tokens = parity.pool_greedy(spec, dec, x, ids, positions, am, ref["gen_tokens"].shape[1])
    np.testing.assert_array_equal(tokens, ref["gen_tokens"])


def test_engine_steps_starvla_heads_on_a_qwen35_prefix_with_language_and_each_head_is_unchanged():
    """QwenPI_v3 (last 3 hidden states) and GR00T (the last) on the hybrid backbone with a language request
    in flight: every chunk bit-identical to the same heads without language (`frame.actions_program`, a
    prefix pass keeping only the heads' reads; see `helpers.FAST_CODEGEN`), and the request finishes."""
    spec = mot.preset("qwen35_tiny")
    model = MultiHead(mot.init_model(spec, seed=0), spec)
    rows, mask = mot_prompt_rows()
    rows = np.where(rows == mot.preset("tiny").image_token_id, 11, rows)  # text only: the heads read hidden states
    n = 3
    eng = Engine(model, EngineConfig(num_slots=2, max_new_tokens=n, admissions_per_frame=2, tokens_per_frame=2))
    rid = eng.submit(max_tokens=n, stop_ids=(), row=1)
    finished = []
    for f in range(2):
        rng = np.random.default_rng(f)
        inputs = mot.make_inputs(spec, rows, mask)
        noises = {h: rng.standard_normal((3, *model.action_shape(h))).astype(np.float32) for h in model.heads}
        states = {h: rng.standard_normal((3, d)).astype(np.float32) for h, d in model.state_dims().items()}
        res = eng.step(inputs, noises, states=states)
        finished += res.finished
        without_language = frame.actions_program(model, inputs, noises, states)  # every head, no language
        for name in model.heads:
            alone = np.asarray(without_language[name])
            if FAST_CODEGEN:  # measured 4.2e-6: the two programs round the layer scan differently
                np.testing.assert_allclose(res.head_actions[name], alone, atol=5e-5, rtol=0, err_msg=f"frame {f} head {name}")
            else:
                np.testing.assert_array_equal(res.head_actions[name], alone, err_msg=f"frame {f} head {name}")
    (done,) = finished  # its tokens alone vs in a pool: test_a_request_decodes_the_same_alone_as_in_a_full_pool...
    assert done.request_id == rid and len(done.tokens) == n
    with pytest.raises(ValueError, match="invalid tokens between valid ones"):
        mot.make_inputs(spec, rows, np.array([[1] * 5 + [0] + [1] * 6] * 3, bool))


def test_slot_bytes_is_the_pools_size_and_the_fixed_state_is_about_1600_tokens_of_kv(tiny):
    spec, dec, _, _ = tiny
    qwen3 = AttentionDecoder(decoder=backbone.abstract_decoder(backbone.preset("qwen3_tiny")), spec=backbone.preset("qwen3_tiny"))
    for lm in (qwen35_decoder.language_model(spec, dec), qwen3):
        pool = decode.init_pool(lm, SLOTS, P, M, Q)
        size = decode.slot_bytes(lm, P, M, Q)
        per_slot = lambda *xs: sum(x.nbytes for x in xs if x is not None) // SLOTS  # noqa: E731
        assert size["kv"] == per_slot(pool.k, pool.v)
        carry = pool.carry or {}  # Qwen3.5: window and state; none for the attention decoder
        assert set(carry) == ({"window", "state"} if lm is not qwen3 else set())
        assert {k: size[k] for k in carry} == {k: per_slot(x) for k, x in carry.items()}
        assert size["total"] == per_slot(*jax.tree.leaves(pool))
        assert harness.pool_slot_bytes(pool) == {k: size[k] for k in ("kv", *carry, "total")}  # the bench's
    # full size (shapes only): ../shared/docs/qwen35.md §5.2's table, bfloat16 activations
    for name, state, window, kv in (("qwen3_5_0.8b", 18_874_368, 884_736, 12_288), ("qwen3_5_4b", 50_331_648, 1_572_864, 32_768)):
        big = qwen35.preset(name)
        lm = qwen35_decoder.language_model(big, qwen35.abstract_decoder(big, "bfloat16"))
        size = decode.slot_bytes(lm, 100, 30, 8)
        assert (size["state"], size["window"], size["kv_per_token"]) == (state, window, kv)
        assert 1500 < size["state_tokens"] < 1700
        pool = jax.eval_shape(lambda lm=lm: decode.init_pool(lm, 2, 100, 30, 8))
        assert size["total"] == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool)) // 2


def test_qwen35_model_specs_take_hidden_state_heads_and_refuse_kv_heads():
    bench = mot.preset("qwen35_bench")  # the bench heads on the bench hybrid (validated at construction)
    assert bench.reads().kv_layers == bench.hybrid.full_layers and bench.reads().hidden_layers == tuple(range(1, 9))
    tiny = mot.preset("qwen35_tiny")
    with pytest.raises(ValueError, match="read K/V, which Qwen3.5's linear-attention layers do not have"):
        tiny.replace(heads=tiny.heads + (mot.preset("tiny").head("xr0").replace(kv_layers=(3, 7)),))
