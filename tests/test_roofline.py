"""The roofline cost model (`eval.bench.roofline_cost`): hand counts on the tiny preset, the exact matrix products
of every family's programs (read off their jaxprs: no compile), XLA's cost analysis of unscanned single layers,
and the report's predictions. The timed path (`eval.bench.roofline_measure`) runs in `python -m eval.roofline`.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from eval.bench import heads as bench_heads
from eval.bench import roofline_cost as rc
from eval.bench import roofline_compare, roofline_peaks, roofline_report
from oxygen_jax.models import heads as hd
from oxygen_jax.models import mot
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.models.backbone import BackboneSpec, RopeSpec
from oxygen_jax.models.qwen35.gated_deltanet import GatedDeltaNetSpec
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.pi05 import model as pi05_model
from oxygen_jax.models.pi05 import params as pi05_params
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.nn import quant
from oxygen_jax.nn.layers import merge_heads, project_heads
from oxygen_jax.runtime import decode, speculative

F32 = rc.Precision.of("float32")


def _dot_flops(jaxpr) -> float:
    """2 per multiply-add of every dot_general and triangular solve, scans times their length, a cond's costliest
    branch: an independent count of a program's matrix products."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lc)
        elif eqn.primitive.name == "triangular_solve":
            a, b = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            total += float(math.prod(b[:-2]) * a[-1] ** 2 * (b[-1] if eqn.params["left_side"] else b[-2]))
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for v in eqn.params.values():
            subs = [x for x in (v if isinstance(v, (tuple, list)) else [v]) if isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr))]
            if subs:
                total += times * max(_dot_flops(getattr(x, "jaxpr", x)) for x in subs)
    return total


def _flops(fn, *args) -> float:
    return _dot_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def _obs(cfg, cameras=2, prompt=12):
    s = cfg.siglip.image_size
    return Observation(images=jnp.zeros((1, cameras, s, s, 3)), image_masks=jnp.ones((1, cameras), bool),
                       tokens=jnp.ones((1, prompt), jnp.int32), token_mask=jnp.ones((1, prompt), bool))


def _abstract_pool(lm, slots, p, m, gamma=0):
    return jax.eval_shape(lambda: decode.init_pool(lm, slots, p, m, 0, speculate=gamma))


def test_hand_counts_tiny_pi05():
    """Tiny π0.5 counted by hand: VLM 64 wide, 2 layers, 4 heads, 2 KV heads x 16, MLP 128, vocabulary 1,024;
    action expert 32 wide, MLP 64; SigLIP 32 wide, 1 layer, MLP 64, 56 px in patches of 14 (16 per image)."""
    m = rc.pi05(model_config("tiny"))
    # Decode step, one slot of length C: per layer q, k|v, out 64x64 each, gate|up 64x256, down 128x64.
    per_layer = 64 * 64 * 3 + 64 * 256 + 128 * 64
    for c in (20, 52):
        cost = rc.decode_step(m, 1, c, F32)
        assert cost.flops == 2 * (2 * per_layer + 1024 * 64) + 2 * 4 * c * 4 * 16
        # Weights: the layers (+ two norms each), the tied table as the head, the final norm, one embedding row.
        assert cost.weights == 4 * (2 * (per_layer + 2 * 64) + 1024 * 64 + 64 + 64)
        assert (cost.kv_read, cost.kv_write) == (4 * 2 * 2 * c * 2 * 16, 4 * 2 * 2 * 1 * 2 * 16)
    # One Euler step of the action expert, Ha = 10 over P = 44: sincos 16, action_in 32x32, time MLP 2 x 32x32 and
    # the adaRMS modulations 32x96 (5 of them) on 1 row; per layer q, k|v, out 32x64 / 64x32, MLP 32x128, 64x32.
    expert = 32 * 64 * 3 + 32 * 128 + 64 * 32
    step = 2 * (16 + 10 * 32 * 32 + 2 * 32 * 32 + 5 * 32 * 96 + 2 * 10 * expert + 10 * 32 * 32) + 2 * 4 * 10 * 54 * 4 * 16
    assert rc.head_step(m, "actions", 44, F32, horizon=10).flops == step
    assert rc.denoise(m, "actions", 44, F32, steps=3, horizon=10).flops == 3 * step
    # SigLIP on 2 images (32 patch rows): stem 588x32, q/k/v/out 32x32, attention within each image, MLP, head 32x64.
    assert rc.vision(m, 2, F32).flops == 2 * 32 * (588 * 32 + 4 * 32 * 32 + 2 * 32 * 64 + 32 * 64) + 4 * 32 * 16 * 32
    assert rc.prefix_length(m, 2, 12) == 2 * 16 + 12


def test_weights_are_the_stored_bytes():
    cfg = model_config("tiny")
    m = rc.pi05(cfg)
    params = pi05_model.as_model(jax.eval_shape(lambda: pi05_params.init_params(cfg, 0)))[1]
    assert rc.count(m.tree) == rc.count(params) == 214_304
    assert rc.from_params(m.spec, params, "tiny").tree.heads["actions"].layers.q.shape == (2, 4, 32, 16)
    bf16 = rc.pi05(cfg, dtype="bfloat16")
    d32, d16 = rc.decode_step(m, 2, 30, F32), rc.decode_step(bf16, 2, 30, rc.Precision.of("bfloat16"))
    assert d16.weights * 2 == d32.weights and d16.kv_read * 2 == d32.kv_read and d16.flops == d32.flops
    int8 = rc.decode_step(m, 2, 30, rc.Precision.of("float32", weight_bytes=1))  # what if: weights only
    assert int8.weights * 4 == d32.weights and int8.kv_read == d32.kv_read
    # A quantized model (`nn.quant`: int8 layer stacks with float32 scales, the rest float32) counts what it stores.
    vla = pi05_model.as_vla(pi05_params.for_backend(quant.quantize_tree(pi05_params.init_params(cfg, 0), "int8"), "cpu"))
    q = rc.decode_step(rc.from_params(vla.spec, vla.params, "int8"), 2, 30, F32)
    layers = rc.count(params.decoder.layers)
    assert q.flops == d32.flops and d32.weights - 3 * layers < q.weights < d32.weights - 2.9 * layers


def _pi05_cases(cfg, language=True):
    m = rc.pi05(cfg)
    spec, params = pi05_model.as_model(jax.eval_shape(lambda: pi05_params.init_params(cfg, 0)))
    obs = _obs(cfg)
    p = 2 * cfg.siglip.num_patches + 12
    prefix_fn = lambda prm, x: mot.prefix_pass(spec, prm, x)  # noqa: E731
    prefix = jax.eval_shape(prefix_fn, params, obs)
    h = spec.heads[0]
    noise = jnp.zeros((1, 10, h.action_dim))
    state = jnp.zeros((1, h.state_dim)) if h.state_dim else None
    yield (rc.denoise(m, h.name, p, F32, steps=2, horizon=10),
           _flops(lambda prm, pr: hd.sample(prm.heads[h.name], h.replace(num_steps=2), pr, noise, state), params, prefix))
    if language:
        yield rc.prefix_pass(m, p, 2, F32), _flops(prefix_fn, params, obs)
        yield from _language_cases(m, spec, params, prefix, p)


def _language_cases(m, spec, params, prefix, p, verify=True, new_tokens=8):
    """A decode step's logits, a verify block (a one-step speculative burst) and an admission."""
    lm = mot.language_model(spec, params)
    pool = _abstract_pool(lm, 3, p, new_tokens)
    yield (rc.decode_step(m, 3, pool.capacity, F32),
           _flops(lambda prm, pl: decode.step_logits(mot.language_model(spec, prm), pl), params, pool))
    if verify:
        pool = _abstract_pool(lm, 2, p, 8, gamma=3)
        yield (rc.verify_block(m, 2, pool.capacity, 3, F32),
               _flops(lambda prm, pl: speculative.verify_burst(mot.language_model(spec, prm), pl, 1), params, pool))
        req = decode.make_requests(2, 0, [0, 1], budgets=[4, 4], stop_ids=[-1, -1])
        yield (rc.admission(m, p, 2, F32), _flops(lambda prm, pl, pr: decode.admit(mot.language_model(spec, prm), pl, pr, req),
                                                  params, _abstract_pool(lm, 3, p, 8), prefix))


def _mot_cases(name):
    """Qwen3-VL (tiny) with XR0, StarVLA and GR00T heads: every head's prepare and two steps, the prefix pass and
    the language cases (a Qwen3.5 backbone's: `_qwen35_unpadded_cases`)."""
    spec = mot.preset(name)
    m = rc.multihead(spec)
    params = mot.abstract_model(spec)
    side = spec.backbone.vision.patch_size * spec.backbone.vision.spatial_merge_size * 2
    ids = bench_heads.prompt_ids(spec, 2, side, 7, np.random.default_rng(0))[None]
    inputs = mot.make_inputs(spec, ids, np.ones(ids.shape, bool), [np.zeros((side, side, 3), np.uint8)] * 2)
    p = ids.shape[1]
    assert rc.prefix_length(m, 2, 7, side) == p
    prefix_fn = lambda prm, x: mot.prefix_pass(spec, prm, x)  # noqa: E731
    prefix = jax.eval_shape(prefix_fn, params, inputs)
    for h in spec.heads:
        noise = jnp.zeros((1, h.horizon, h.action_dim))
        state = jnp.zeros((1, h.state_dim)) if h.state_dim else None
        yield (rc.head_prepare(m, h.name, p, F32) + rc.head_step(m, h.name, p, F32).times(2),
               _flops(lambda prm, pr: hd.sample(prm.heads[h.name], h.replace(num_steps=2), pr, noise, state), params, prefix))
    yield rc.prefix_pass(m, p, 2, F32, image_size=side), _flops(prefix_fn, params, inputs)
    yield from _language_cases(m, spec, params, prefix, p)


def _qwen35_unpadded_cases():
    """A one-group Qwen3.5 whose every product output is a multiple of 64 wide: its torch-order products pad
    nothing (`nn.torch_order`), so the program's products are exactly the model's."""
    b = BackboneSpec(family="qwen3_5", width=64, depth=2, num_heads=1, num_kv_heads=1, head_dim=64, mlp_dim=128,
                     vocab_size=512, mlp="swiglu", norm_plus_one=True, qk_norm=True, rope=RopeSpec(theta=1e7),
                     embed_scale=False, tie_embeddings=True, rotary_dim=16)
    q = qwen35.Qwen35Spec(backbone=b, gdn=GatedDeltaNetSpec(num_key_heads=2, num_value_heads=64, key_dim=64, value_dim=64),
                          layer_types=("linear_attention", "full_attention"))
    spec = mot.ModelSpec(backbone=b, hybrid=q, heads=(), language=True)
    m, params = rc.multihead(spec), mot.abstract_model(spec)
    inputs = mot.make_inputs(spec, np.ones((1, 64), np.int32), np.ones((1, 64), bool))
    prefix_fn = lambda prm, x: mot.prefix_pass(spec, prm, x)  # noqa: E731
    yield rc.prefix_pass(m, 64, 0, F32), _flops(prefix_fn, params, inputs)
    prefix = jax.eval_shape(prefix_fn, params, inputs)
    yield from _language_cases(m, spec, params, prefix, 64, verify=False, new_tokens=64)  # C = 128


@pytest.mark.parametrize("family", ["pi05", "pi0", "qwen3_vl_heads", "qwen35_unpadded"])
def test_costs_equal_the_programs_matrix_products(family):
    """Every component's FLOPs equal the dot_general / triangular-solve work of the program it models, exactly."""
    cases = {"pi05": lambda: _pi05_cases(model_config("tiny")),
             "pi0": lambda: _pi05_cases(model_config("tiny", variant="pi0"), language=False),
             "qwen3_vl_heads": lambda: _mot_cases("tiny"),
             "qwen35_unpadded": _qwen35_unpadded_cases}[family]()
    n = 0
    for cost, program in cases:
        assert cost.flops == program, (n, cost.flops, program)
        n += 1
    assert n >= 1


def test_xla_cost_analysis_of_single_layers():
    """One-layer π0.5 (unrolled, no scan): XLA counts the model's products plus element-wise work, which stays
    under 15 % of them even at these tiny widths."""
    cfg = model_config("tiny")
    one = lambda e: dataclasses.replace(e, depth=1)  # noqa: E731
    cfg = cfg.replace(vlm=one(cfg.vlm), action_expert=one(cfg.action_expert), siglip=one(cfg.siglip))
    m = rc.pi05(cfg)
    spec, params = pi05_model.as_model(jax.eval_shape(lambda: pi05_params.init_params(cfg, 0)))
    params = jax.eval_shape(lambda p: mot.for_backend(spec, p, "cpu"), params)
    obs = _obs(cfg)
    prefix = jax.eval_shape(lambda prm, x: mot.prefix_pass(spec, prm, x), params, obs)
    pool = _abstract_pool(mot.language_model(spec, params), 2, 44, 8)
    h = spec.heads[0].replace(num_steps=1)
    noise = jnp.zeros((1, 10, h.action_dim))
    programs = [(rc.prefix_pass(m, 44, 2, F32), lambda prm, x: mot.prefix_pass(spec, prm, x), obs),
                (rc.denoise(m, h.name, 44, F32, steps=1, horizon=10),
                 lambda prm, pr: hd.sample(prm.heads[h.name], h, pr, noise), prefix),
                (rc.decode_step(m, 2, pool.capacity, F32),
                 lambda prm, pl: decode.step_logits(mot.language_model(spec, prm), pl), pool)]
    for cost, fn, arg in programs:
        analysis = jax.jit(fn).lower(params, arg).compile().cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        assert 1.0 <= analysis["flops"] / cost.flops < 1.15, (analysis["flops"], cost.flops)


def test_every_tiny_family_has_a_frame_and_predictions():
    models = [rc.pi05(model_config("tiny")), rc.pi05(model_config("tiny", variant="pi0")),
              rc.multihead(mot.preset("tiny")), rc.multihead(mot.preset("qwen35_tiny"))]
    device = roofline_peaks.datasheet("RTX 4090")
    for m in models:
        size = None if m.spec.input_kind == "observation" else 32  # SigLIP: its own size
        w = roofline_report.Workload(prefix_len=rc.prefix_length(m, 2, 10, size), images=2, horizon=10, steps=None,
                                     decode_len=8, tokens_per_frame=2, slots=4, image_size=size)
        parts = rc.frame_parts(m, w.plan(), F32)
        assert {"prefix", "admission", "decode"} <= set(parts) and len(parts) == 3 + len(m.spec.heads)
        for cost in parts.values():
            assert all(math.isfinite(x) and x >= 0 for x in dataclasses.astuple(cost)) and cost.bytes > 0
        pred = roofline_report.predict(m, w, F32, device)
        ha = m.spec.heads[0].horizon or 10  # the first head's chunk (π0.5's: the workload's)
        assert pred["isolated_ms"] > pred["frame_ms"] > 0 and pred["action_hz"] == pytest.approx(ha * 1e3 / pred["frame_ms"])


def test_limits_and_refusals(monkeypatch):
    c = rc.Cost(flops=4e9, weights=1e9)
    assert c.limit_s(2e9, 1e9) == 2.0 and c.bound(2e9, 1e9) == "compute"
    assert c.limit_s(8e9, 1e9) == 1.0 and c.bound(8e9, 1e9) == "memory"
    with pytest.raises(ValueError, match="dtype must be one of"):
        rc.Precision.of("int4")
    with pytest.raises(ValueError, match="weight_bytes must be None or a positive"):
        rc.Precision.of("float32", weight_bytes=0)
    m = rc.pi05(model_config("tiny"))
    with pytest.raises(ValueError, match="pass horizon=Ha"):
        rc.head_step(m, "actions", 10, F32)
    monkeypatch.delitem(rc.HEAD_COSTS, "adarms_joint")
    with pytest.raises(ValueError, match="no cost model for head kind 'adarms_joint'"):
        rc.head_step(m, "actions", 10, F32, horizon=1)
    with pytest.raises(ValueError, match="no datasheet"):
        roofline_peaks.datasheet("TPU")


def test_peaks_probe_is_positive():
    p = roofline_peaks.measure(probe_bytes=1 << 18, sizes=(32,), repeats=1)
    assert p.matmul_flops > 0 and p.copy_bandwidth > 0 and p.bandwidth == max(p.sum_bandwidth, p.gemv_bandwidth) > 0


@pytest.mark.parametrize("eq, x_shape, w_shape", [("BTD,NDH->BTNH", (1, 3, 32), (4, 32, 16)),
                                                  ("BTD,2KDH->BT2KH", (1, 3, 32), (2, 2, 32, 16)),
                                                  ("BTNH,NHD->BTD", (1, 3, 4, 16), (4, 16, 32))])
def test_head_projections_equal_the_einsum_without_weight_copies(eq, x_shape, w_shape):
    """`nn.layers.project_heads` / `merge_heads` (issue 44 item 4): the einsum's values within float32 rounding, and
    no copy or transpose of the weight in the compiled program (the plain einsum has one on XLA:CPU)."""
    r = np.random.default_rng(0)
    x, w = (jnp.asarray(r.standard_normal(s, np.float32)) for s in (x_shape, w_shape))
    fn = merge_heads if eq.endswith("->BTD") else project_heads
    np.testing.assert_allclose(fn(x, w), jnp.einsum(eq, x, w), rtol=1e-5, atol=1e-5)
    hlo = jax.jit(fn).lower(x, w).compile().as_text()
    copied = [math.prod(int(d) for d in s.split(",")) for s in re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} (?:copy|transpose)\(", hlo)]
    assert math.prod(w_shape) not in copied, f"{fn.__name__} copies its weight: {hlo}"


def test_compare_pairs_runs_in_order():
    """`eval.bench.roofline_compare`: each pair's ratio and fractions, the medians, and unpaired runs refused."""
    def run(ms, frac, load):
        return {"components": [{"name": "decode1", "ms": ms, "fraction_of_limit": frac}], "loadavg_start": [load],
                "loadavg_end": [load], "peaks": {"bandwidth": 2e10, "matmul_flops": 1e11}}

    text = roofline_compare.compare([run(100.0, 0.5, 1.0), run(80.0, 0.6, 2.0)], [run(50.0, 1.0, 1.5), run(60.0, 0.8, 2.5)])
    assert "| decode1 | 1 | 100.0 | 50.0 | 0.50 | 0.50 | 1.00 |" in text
    assert "| **decode1** | median | 90.0 | 55.0 | 0.62 | 0.55 | 0.90 |" in text and "after load 2.5 -> 2.5" in text
    with pytest.raises(ValueError, match="pair the runs"):
        roofline_compare.compare([run(1.0, 1.0, 1.0)], [])
