"""Per-request language adapters on Qwen3.5 (`qwen35.HybridBank`: LoRA on both layer kinds).

Invariants: a row on adapter n computes what the merged weights W + ΔW compute (`qwen35.merge_adapter`),
in the chunked (request prompt) and the recurrent (decode step) form, hidden states and the linear
layers' window and state alike; a row on id 0 is bit-identical to the bank-free program; in the decode
pool, requests on different adapters decode beside each other the greedy tokens each decodes alone on
its merged weights (`helpers.FAST_CODEGEN`: id 0 within 1e-4 under the suite's fast-compile flags); banks of the wrong kind or shape and adapter ids the bank does not store are
refused with one line naming the problem; `abstract_bank` gives full-size bank shapes without
allocating.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FAST_CODEGEN
from oxygen_jax.models.qwen35 import decoder as qwen35_decoder
from oxygen_jax.models.decoder import AttentionDecoder
from oxygen_jax.models import backbone, lora
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.models.lora import RowAdapters
from oxygen_jax.runtime import decode

P, Q, M, SLOTS = 10, 3, 6, 4  # prefix length, request-prompt capacity, new tokens, slots


@pytest.fixture(scope="module")
def tiny():
    """The fixture's dims with random weights and a 2-adapter bank of random (non-zero) factors on every
    target of both layer kinds; alpha 8 over rank 4 exercises the scaling."""
    spec = qwen35.preset("qwen35_tiny")
    dec = qwen35.init_decoder(spec, seed=3)
    bank = qwen35.init_bank(spec, 2, 4, alpha=8.0, seed=1, b_std=0.02)
    return spec, dec, bank


def _step_inputs(spec, dec, b=3, t=5, s=8):
    rng = np.random.default_rng(0)
    x = backbone.embed_tokens(spec.backbone, dec, jnp.asarray(rng.integers(4, 500, (b, t)).astype(np.int32)))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    bs = spec.backbone
    kv = jnp.zeros((len(spec.full_layers), b, s, bs.num_kv_heads, bs.head_dim))
    mask = jnp.broadcast_to(jnp.arange(s)[None, None] <= jnp.arange(t)[None, :, None], (b, t, s))
    window, state = qwen35.empty_state(spec, b, jnp.float32)
    return x, pos, jnp.ones((b, t), bool), mask, kv, kv, pos, window, state


def _forward(spec, layers, inputs, form, bank_ids=None):
    fn = jax.jit(lambda layers, lora_rows: qwen35.forward_step(spec, layers, *inputs, form=form, lora=lora_rows))
    out = fn(layers, None if bank_ids is None else RowAdapters(*bank_ids))
    h, _, (window, state) = jax.tree.map(np.asarray, out)
    return h, window, state


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_a_row_on_adapter_n_equals_the_merged_weights_and_id_0_the_bank_free_program(tiny, form):
    spec, dec, bank = tiny
    inputs = _step_inputs(spec, dec)
    ids = jnp.array([0, 1, 2], jnp.int32)
    base = _forward(spec, dec.layers, inputs, form)
    rows = _forward(spec, dec.layers, inputs, form, (bank, ids))
    for got, want in zip(rows, base):  # hidden [B, ...]; window, state [Lg, B, ...]
        got_0, want_0 = (got[0], want[0]) if got is rows[0] else (got[:, 0], want[:, 0])
        if FAST_CODEGEN:  # measured 2e-5: the two programs round the delta rule differently
            assert _rel(got_0, want_0) < 1e-4
        else:
            np.testing.assert_array_equal(got_0, want_0)
    for n in (1, 2):
        merged = _forward(spec, qwen35.merge_adapter(spec, dec, bank, n).layers, inputs, form)
        assert _rel(base[0][n], merged[0][n]) > 0.05  # the adapter matters ...
        assert _rel(rows[0][n], merged[0][n]) < 1e-4  # ... and the per-row path is its merged weights
        for got, want in zip(rows[1:], merged[1:]):  # window and state: what the adapter made them
            assert _rel(got[:, n], want[:, n]) < 1e-4


def _requests(rids, adapters):
    prompts = {0: [5, 6], 1: [], 2: [7], 3: [9, 10, 11]}
    return decode.make_requests(SLOTS, Q, list(rids), rows=[r % 2 for r in rids], prompts=[prompts[r] for r in rids],
                                budgets=[M] * len(rids), stop_ids=[-1] * len(rids), adapters=list(adapters))


def _decode(lm, prefix, rids, adapters, bank):
    pool = decode.init_pool(lm, SLOTS, P, M, Q)
    pool, admitted, _ = decode.admit(lm, pool, prefix, _requests(rids, adapters), bank)
    assert bool(np.all(np.asarray(admitted)[: len(rids)]))
    pool, _ = decode.decode_burst(lm, pool, 2, bank)  # the first requests are older than the last one
    if len(rids) > 1:
        pool, _, _ = decode.admit(lm, pool, prefix, _requests([3], [2]), bank)
    for _ in range(M // 2):  # bursts of one length: one compiled burst per bank kind
        pool, _ = decode.decode_burst(lm, pool, 2, bank)
    return {int(r): [int(t) for t in np.asarray(pool.tokens[s]) if t >= 0]
            for s, r in enumerate(np.asarray(pool.request_id)) if r >= 0}


def test_requests_on_different_adapters_decode_in_one_pool_what_each_decodes_alone_on_merged_weights(tiny):
    spec, dec, bank = tiny
    rng = np.random.default_rng(1)
    ids = rng.integers(4, 500, (2, P)).astype(np.int32)
    mask = np.arange(P)[None] >= np.array([0, 4])[:, None]  # row 1 left-padded
    pos = np.where(mask, np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    x = backbone.embed_tokens(spec.backbone, dec, jnp.asarray(ids))
    prefix = jax.jit(qwen35.prefix_pass, static_argnums=0)(spec, dec, x, jnp.asarray(pos), jnp.asarray(mask))  # shared base prefix
    lm = qwen35_decoder.language_model(spec, dec)
    together = _decode(lm, prefix, [0, 1, 2], [1, 0, 2], bank)  # + request 3 on adapter 2, two tokens later
    assert sorted(together) == [0, 1, 2, 3] and all(len(t) == M for t in together.values())
    alone = {}
    for rid, adapter in ((0, 1), (1, 0), (2, 2), (3, 2)):
        weights = dec if adapter == 0 else qwen35.merge_adapter(spec, dec, bank, adapter)
        alone[rid] = _decode(qwen35_decoder.language_model(spec, weights), prefix, [rid], [0], None)[rid]
    assert together == alone
    base_0 = _decode(lm, prefix, [0], [0], None)[0]
    assert base_0 != together[0]  # adapter 1 changes request 0's text


def test_wrong_banks_and_unstored_adapter_ids_are_refused_with_one_line(tiny):
    spec, dec, bank = tiny
    with pytest.raises(ValueError, match=r"adapter id 3 is not stored in this bank \(ids 1..2"):
        bank.adapter(3)
    other = qwen35.init_bank(dataclasses.replace(spec, backbone=spec.backbone.replace(mlp_dim=96)), 2, 4)
    with pytest.raises(ValueError, match=r"does not fit this Qwen3.5 spec.*gating"):
        qwen35.check_bank(spec, other)
    with pytest.raises(ValueError, match="serves a qwen35.HybridBank"):
        qwen35.check_bank(spec, lora.LoraBank(adapters=bank.full))
    with pytest.raises(ValueError, match="need num_adapters >= 1, rank >= 1"):
        qwen35.init_bank(spec, 1, 2, linear_targets=("q",))
    lm = qwen35_decoder.language_model(spec, dec)
    pool = decode.init_pool(lm, SLOTS, P, M, Q)
    prefix = jax.eval_shape(lambda: None)  # never reached: the ids are checked on the host first
    with pytest.raises(ValueError, match=r"request adapter id 5 is out of range: the bank serves ids 0..2"):
        decode.admit(lm, pool, prefix, _requests([0], [5]), bank)
    with pytest.raises(ValueError, match=r"adapter id 1 is out of range: the bank serves no bank: only id 0"):
        decode.admit(lm, pool, prefix, _requests([0], [1]), None)
    qwen3 = backbone.preset("qwen3_tiny")
    qwen3_lm = AttentionDecoder(decoder=backbone.init_decoder(qwen3, seed=0), spec=qwen3)
    qwen3_pool = decode.init_pool(qwen3_lm, SLOTS, P, M, Q)
    with pytest.raises(ValueError, match="HybridBank serves Qwen3.5 language models only"):
        decode.step_logits(qwen3_lm, qwen3_pool, bank)


@pytest.mark.parametrize("name", ["qwen3_5_0.8b", "qwen3_5_9b"])
def test_abstract_bank_has_full_size_shapes_from_the_spec(name):
    spec = qwen35.preset(name)
    r, e = 16, 3
    bank = qwen35.abstract_bank(spec, e, r, "bfloat16")
    qwen35.check_bank(spec, bank)
    g, b = spec.gdn, spec.backbone
    nf, nl = len(spec.full_layers), len(spec.linear_layers)
    assert bank.num_adapters == e and bank.full.q.a.dtype == jnp.bfloat16
    assert bank.linear.qkv.b.shape == (spec.num_groups, spec.group.count("linear_attention"), e, r, g.conv_channels)
    assert bank.linear.out.a.shape[-3:] == (g.num_value_heads, g.value_dim, r)
    # per adapter and layer: r x (fan-in + fan-out) per projection, per head for q / k / v / out
    full = r * (2 * (b.num_heads + b.num_kv_heads) * (b.width + b.head_dim) + 3 * (b.width + b.mlp_dim))
    lin = r * ((b.width + g.conv_channels) + (b.width + g.num_value_heads * g.value_dim) * 2 + 3 * (b.width + b.mlp_dim))
    assert sum(x.size for x in jax.tree.leaves(bank)) == e * (nf * full + nl * lin)


def test_the_engine_serves_a_hybrid_bank_by_adapter_name_beside_the_base_model():
    """`Engine(bank=HybridBank)` on a Qwen3.5 MultiHead: a request on adapter "a" and one on "base" decode in
    the same frames from one shared prefix. Their first token comes from the prefix (base weights, so
    equal), the rest from the suffix path (adapter: different); unknown names are refused."""
    from helpers import mot_prompt_rows
    from oxygen_jax.models import mot
    from oxygen_jax.runtime.engine import Engine, EngineConfig
    from oxygen_jax.models.vla import MultiHead

    spec = mot.preset("qwen35_tiny")
    model = MultiHead(mot.init_model(spec, seed=0), spec)
    bank = qwen35.init_bank(spec.hybrid, 1, 2, seed=1, b_std=0.5)
    rows, mask = mot_prompt_rows()
    rows = np.where(rows == mot.preset("tiny").image_token_id, 11, rows)  # text only
    eng = Engine(model, EngineConfig(num_slots=2, max_new_tokens=4, admissions_per_frame=2, tokens_per_frame=2),
                 bank=bank, adapter_names=["a"])
    with pytest.raises(ValueError, match="unknown adapter 'b'"):
        eng.submit(max_tokens=4, row=1, adapter="b")
    ids = {eng.submit(max_tokens=4, stop_ids=(), row=1, adapter=name): name for name in ("a", "base")}
    finished = {}
    for f in range(3):
        rng = np.random.default_rng(f)
        noises = {h: rng.standard_normal((3, *model.action_shape(h))).astype(np.float32) for h in model.heads}
        states = {h: rng.standard_normal((3, d)).astype(np.float32) for h, d in model.state_dims().items()}
        res = eng.step(mot.make_inputs(spec, rows, mask), noises, states=states)
        finished |= {ids[r.request_id]: list(r.tokens) for r in res.finished}
    assert sorted(finished) == ["a", "base"] and all(len(t) == 4 for t in finished.values())
    assert finished["a"][0] == finished["base"][0] and finished["a"][1:] != finished["base"][1:]
