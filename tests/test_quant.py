"""Quantized weights (`nn.quant`, `ckpts.own`, `python -m oxygen_jax.quantize`): round-trip error bounds per
dtype, a quantized tiny π0.5 within the documented bounds of float32 (docs/quantization.md), the layer loop's
dequantization in both layer layouts (and in Qwen3.5's own group scan), the checkpoint round trip and its
refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import diverse_text_params, leaves_equal, make_obs
from oxygen_jax.ckpts.adapters import base_fingerprint
from oxygen_jax.ckpts.load import load_model
from oxygen_jax.ckpts.openpi import load_openpi_params
from oxygen_jax.ckpts.orbax_io import CheckpointError
from oxygen_jax.ckpts.own import quantization_info, restore_params, save_params
from oxygen_jax.models import backbone
from oxygen_jax.models.pi05 import model as pi05_model
from oxygen_jax.models.pi05 import params as pi05_params
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import init_params, stack_layers
from oxygen_jax.models.pi05.spec import pi05_spec
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.nn import quant
from oxygen_jax.nn import layers
from oxygen_jax.nn.layers import Unstacked, unstack_layers
from oxygen_jax.nn.masks import make_attn_mask
from oxygen_jax.quantize import main as quantize_main, quantize_checkpoint

# Documented bounds (docs/quantization.md) for the tiny preset's random weights made text-diverse: actions
# against float32, relative to the float32 actions' RMS; teacher-forced greedy tokens identical to float32's.
BOUNDS = {"int8": {"max": 0.25, "mean": 0.03, "tokens": 0.75}, "fp8": {"max": 0.75, "mean": 0.1, "tokens": 0.4}}
# The same with int8 x int8 / fp8 x fp8 matmuls on activations quantized per row, embedding / LM head included.
DYNAMIC_BOUNDS = {"int8": {"max": 0.3, "mean": 0.05, "tokens": 0.6}, "fp8": {"max": 0.9, "mean": 0.2, "tokens": 0.4}}


def _weight(seed: int, shape=(3, 2, 48, 40)) -> np.ndarray:
    """Channels of very different magnitudes, one all-zero channel and a few outliers."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-6, 2, shape[:1] + (1,) * 2 + shape[-1:]))
    w[0, 0, :, 3] = 0.0
    w[1, 1, 5, 7] = 50.0
    return w.astype(np.float32)


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_round_trip_error_is_within_the_format_bound(weights):
    w = _weight(0)
    q = quant.quantize(w, weights, axes=(-2,))
    assert q.values.dtype == quant.STORED_DTYPE[weights] and q.scale.shape == (3, 2, 1, 40)
    assert q.scale.dtype == np.float32 and (q.scale > 0).all()
    back = np.asarray(quant.dequantize(jax.tree.map(jnp.asarray, q)))
    err = np.abs(back - w)
    assert (err <= quant.error_bound(q, w) * (1 + 1e-6) + 1e-30).all(), float((err / quant.error_bound(q, w)).max())
    # Each channel's absmax lands on the format's largest value, and an all-zero channel stays exactly zero.
    top = np.max(np.abs(np.asarray(q.values, np.float32)), axis=-2)
    assert np.allclose(top[np.max(np.abs(w), axis=-2) > 0], quant.QMAX[weights])
    assert (back[0, 0, :, 3] == 0).all()
    # The bound is tight enough to mean something: int8 about 0.4 % of a channel's absmax, fp8 about 6 % of |w|.
    rel = err / np.max(np.abs(w), axis=-2, keepdims=True).clip(1e-30)
    assert rel.max() <= (0.5 / 127 if weights == "int8" else 2.0 ** -4) * 1.0001


def test_quantize_reads_large_leaves_in_blocks_with_the_same_result(monkeypatch):
    w = _weight(1, (6, 32, 24))
    whole = quant.quantize(w, "int8", axes=(-2,))
    monkeypatch.setattr(quant, "_BLOCK", 100)  # a few rows of axis 0 at a time
    blocked = quant.quantize(w, "int8", axes=(-2,))
    assert (whole.values == blocked.values).all() and (whole.scale == blocked.scale).all()


def test_quantize_refuses_bad_input_in_one_line():
    with pytest.raises(ValueError, match="NaN or inf"):
        quant.quantize(np.full((2, 3), np.nan, np.float32), "int8", axes=(-2,))
    with pytest.raises(ValueError, match="int8' or 'fp8"):
        quant.quantize(np.ones((2, 3), np.float32), "int4", axes=(-2,))
    with pytest.raises(ValueError, match="not distinct axes"):
        quant.quantize(np.ones((2, 3), np.float32), "int8", axes=(-3,))
    with pytest.raises(ValueError, match="Unstacked"):
        quant.plan({"vlm": {"layers": Unstacked(layers=({"q": np.ones((2, 3, 2))},))}})


def test_plan_selects_layer_weights_by_kind_and_keeps_the_rest(tiny):
    params = tiny[1]
    both, mlp = quant.plan(params), quant.plan(params, ("mlp",))
    assert set(mlp) < set(both) and {r.kind for r in mlp.values()} == {"mlp"}
    assert {"vlm/layers/q", "vlm/layers/gating", "action_expert/layers/out", "siglip/layers/query/kernel"} <= set(both)
    # Norms enter only as the adaptive norms' modulation projections (their own kind); scales, biases stay float.
    assert {r.kind for p, r in both.items() if "norm" in p} == {"adanorm"} and \
        "action_expert/layers/ffw_norm/modulation/kernel" in both
    assert not any(p.endswith(("scale", "bias")) or "embedding" in p or "time_mlp" in p for p in both)


@pytest.fixture(scope="module")
def tiny():
    config = model_config("tiny", prompt_attention="causal")
    return config, diverse_text_params(init_params(config, 0))


@jax.jit
def _actions_and_tokens(params, obs, noise):
    """One action chunk per row and the teacher-forced greedy token after every prefix position."""
    out = pi05_model.prefix_forward(params, obs)
    tokens = jnp.argmax(pi05_model.lm_logits(params, pi05_model.final_norm(params, out["hidden"])), -1)
    return pi05_model.sample_actions(params, obs, noise, 1), tokens


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_quantized_tiny_model_is_within_the_documented_bounds_of_float32(tiny, weights):
    config, params = tiny
    obs = make_obs(config, batch=2, prompt_len=16)
    noise = jax.random.normal(jax.random.key(1), (2, 10, config.action_dim))
    ref_a, ref_t = map(np.asarray, _actions_and_tokens(params, obs, noise))
    qparams = quant.quantize_tree(params, weights)
    act, tok = map(np.asarray, _actions_and_tokens(qparams, obs, noise))
    # The quantized run is the float program on the dequantized weights: the layer loop is the only change.
    deq_a, deq_t = map(np.asarray, _actions_and_tokens(quant.dequantize_tree(qparams), obs, noise))
    np.testing.assert_allclose(act, deq_a, rtol=1e-5, atol=1e-5 * np.abs(ref_a).max())
    assert (tok == deq_t).all()
    scale = np.sqrt(np.mean(ref_a ** 2))
    err = np.abs(act - ref_a) / scale
    prompt = np.asarray(obs.token_mask)
    agree = (tok[:, -prompt.shape[1]:] == ref_t[:, -prompt.shape[1]:])[prompt].mean()
    bound = BOUNDS[weights]
    assert 0 < err.mean() <= bound["mean"] and err.max() <= bound["max"], (err.max(), err.mean())
    assert bound["tokens"] <= agree, agree
    # Dynamic-range matmuls (`--quant-matmul int8 / fp8`), the embedding and tied LM head quantized too: every
    # dynamic leaf's matmul on activations quantized per row (SigLIP and the adaptive norms stay weight-only).
    dyn = quant.with_matmul(quant.quantize_tree(params, weights, quant.ALL_KINDS), weights)
    assert quant.matmul_summary(dyn) == {weights: 11, "weight_only": 8} and dyn.embedding.matmul == weights
    act, tok = map(np.asarray, _actions_and_tokens(dyn, obs, noise))
    err = np.abs(act - ref_a) / scale
    agree = (tok[:, -prompt.shape[1]:] == ref_t[:, -prompt.shape[1]:])[prompt].mean()
    bound = DYNAMIC_BOUNDS[weights]
    assert 0 < err.mean() <= bound["mean"] and err.max() <= bound["max"], (err.max(), err.mean())
    assert bound["tokens"] <= agree, agree


def test_layer_loop_dequantizes_stacked_and_unstacked_layers_alike(tiny):
    config, params = tiny
    layers = quant.quantize_tree(params, "int8").vlm.layers
    spec = pi05_spec(config)
    x = jax.random.normal(jax.random.key(2), (1, 6, config.vlm.width))
    pos = jnp.arange(6)[None]
    mask = make_attn_mask(jnp.ones((1, 6), bool), jnp.ones(6, bool))
    run = jax.jit(lambda lay: backbone.forward_prefill(spec, lay, x, pos, mask)[0])
    stacked = np.asarray(run(layers))
    np.testing.assert_allclose(np.asarray(run(unstack_layers(layers))), stacked, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(run(quant.dequantize_tree(layers))), stacked, rtol=1e-5, atol=1e-5)


@jax.jit
def _helper_products(x, weights):
    """Every projection helper's output for each mode's weights {mode: (heads, out, down, table)}, and the rows of
    its activations quantized as the helpers quantize them (x [3, 5, 16]; one program for both modes)."""
    got = {}
    for mode, (heads, out, down, table) in weights.items():
        a, h = x.reshape(3, 5, 2, 8), x.reshape(15, 16)
        got[mode] = {"heads": layers.project_heads(x, heads), "merge": layers.merge_heads(a, out), "down": x @ down,
                     "logits": layers.vocab_logits(h, table), "vocab_major": layers.vocab_logits(h, table, True),
                     "rows": quant.quantize_rows(h, mode)}
    return got


def test_dynamic_products_are_the_products_of_the_dequantized_operands():
    """Every projection helper (the choke point) gives x's rows quantized times the stored values, both scales
    applied: float64 products of the dequantized operands, to float32 rounding."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 5, 16)).astype(np.float32) * np.float32([[[1]], [[30]], [[1e-3]]]))
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-3, 2, shape[-1:]))  # noqa: E731
    raw = {"heads": (w(4, 16, 8), (-2,)), "out": (w(2, 8, 16), (-3, -2)), "down": (w(16, 12), (-2,)),
           "table": (w(16, 40).T, (-1,))}  # [N, D, H], [N, H, D], [F, D] (`h @ w`), [V, D] (a scale per row)
    weights = {m: tuple(dataclasses.replace(jax.tree.map(jnp.asarray, quant.quantize(a, m, axes)), matmul=m)
                        for a, axes in raw.values()) for m in ("int8", "fp8")}
    got = jax.device_get(_helper_products(x, weights))
    deq = lambda q: np.asarray(q.values, np.float64) * np.asarray(q.scale, np.float64)  # noqa: E731
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-30)  # noqa: E731
    for mode, (heads, out, down, table) in weights.items():
        g = got[mode]
        xq, sx = g["rows"]
        xd = np.asarray(xq, np.float64) * np.asarray(sx, np.float64)  # [15, 16], the rows as quantized
        # per row: int8 half a step; fp8 2^-4 of the row's absmax (= 28 steps of absmax / 448)
        assert (np.abs(xd - np.asarray(x).reshape(15, 16)) <= np.asarray(sx) * (0.5 if mode == "int8" else 28) * 1.0001).all()
        close(g["heads"], np.einsum("yd,ndh->ynh", xd, deq(heads)).reshape(3, 5, 4, 8))
        close(g["merge"], (xd @ deq(out).reshape(16, 16)).reshape(3, 5, 16))
        close(g["down"], (xd @ deq(down)).reshape(3, 5, 12))
        close(g["logits"], xd @ deq(table).T)
        close(g["vocab_major"], (xd @ deq(table).T).T)


def test_embedding_kind_scales_each_row_and_the_lookup_is_the_dequantized_table_lookup(tiny):
    params = tiny[1]
    assert set(quant.plan(params, ("embed",))) == {"embedding"}  # only when named: the default kinds keep it float
    q = quant.quantize_tree(params, "int8", ("embed",)).embedding
    assert q.values.shape == params.embedding.shape and q.scale.shape == (params.embedding.shape[0], 1)
    ids = jnp.asarray([[0, 5, 5], [params.embedding.shape[0] - 1, 2, 7]])
    np.testing.assert_array_equal(np.asarray(layers.take_rows(q, ids)), np.asarray(quant.dequantize(q))[ids])
    assert (np.abs(np.asarray(quant.dequantize(q)) - np.asarray(params.embedding)) <= np.asarray(q.scale) / 2 * 1.0001).all()


H100 = quant.DeviceInfo(platform="gpu", kind="NVIDIA H100 80GB HBM3", capability=(9, 0))
A100 = quant.DeviceInfo(platform="gpu", kind="NVIDIA A100-SXM4-80GB", capability=(8, 0))
CPU = quant.DeviceInfo(platform="cpu", kind="cpu")


def test_auto_matmul_mode_follows_the_device_and_the_weights():
    auto = lambda w, d: quant.choose_matmul("auto", w, d)  # noqa: E731
    assert (auto("fp8", H100), auto("int8", H100), auto("fp8", A100), auto("int8", A100)) == ("fp8", "int8", "weight_only", "int8")
    # XLA:CPU runs s8 dots natively and fp8 ones only by converting to float32 (docs/quantization.md): never auto.
    assert (auto("int8", CPU), auto("fp8", CPU), auto(None, H100)) == ("int8", "weight_only", "weight_only")
    tpu, rocm = quant.DeviceInfo(platform="tpu", kind="TPU v5e"), quant.DeviceInfo(platform="rocm", kind="MI300X")
    assert (auto("fp8", tpu), auto("int8", tpu), auto("int8", rocm)) == ("weight_only", "int8", "weight_only")
    assert quant.device_info(jax.devices()[0]).platform == jax.devices()[0].platform
    fake = lambda cc, version="": type("Device", (), {"platform": "gpu", "device_kind": "GPU", "compute_capability": cc,  # noqa: E731
                                                      "client": type("Client", (), {"platform_version": version})()})()
    assert quant.device_info(fake("8.9")) == quant.DeviceInfo(platform="gpu", kind="GPU", capability=(8, 9))
    assert quant.device_info(fake("gfx90a", "rocm 6.2")).platform == "rocm"  # jax says "gpu" for ROCm too
    assert quant.choose_matmul("fp8", "fp8", CPU) == "fp8"  # forced: emulated, for numerics checks


def test_a_forced_matmul_mode_is_refused_where_the_device_or_the_weights_lack_it(tiny):
    with pytest.raises(ValueError, match=r"A100.*compute capability 8\.0\) has no fp8 x fp8 matmuls.*8\.9"):
        quant.choose_matmul("fp8", "fp8", A100)
    with pytest.raises(ValueError, match="'MI300X' on rocm has no int8 x int8 matmuls"):
        quant.choose_matmul("int8", "int8", quant.DeviceInfo(platform="rocm", kind="MI300X"))
    with pytest.raises(ValueError, match="needs int8 weights and this model's are fp8"):
        quant.choose_matmul("int8", "fp8", H100)
    with pytest.raises(ValueError, match="this model has none"):
        quant.start_matmul(tiny[1], "int8", jax.devices()[0])
    assert quant.start_matmul(tiny[1], "auto", jax.devices()[0]) == (tiny[1], "")  # a float model: untouched
    assert quant.weights_info(tiny[1]) == {"quantized": None}
    if jax.devices()[0].platform == "cpu":  # what run prints and serve's metadata says on this CPU
        q, line = quant.start_matmul(quant.quantize_tree(tiny[1], "int8", ("mlp",)), "auto", jax.devices()[0])
        assert line == "int8 weights, int8 matmuls (auto on cpu)"
        assert quant.weights_info(q) == {"quantized": "int8", "matmul": {"int8": 4, "weight_only": 2}}  # SigLIP's 2
        # The CPU layout (a buffer per layer) keeps the same leaves dynamic, each layer's own.
        per_layer = quant.with_matmul(pi05_params.unstack_layers(q), "int8")
        assert quant.matmul_summary(per_layer) == {"int8": 8, "weight_only": 2}


# --------------------------------------------------------------------------------------------
# Qwen3.5: its own scan over layer groups, dequantized by the same wrapper as `scan_layers`

# Logits error relative to the float32 logits' RMS, and teacher-forced greedy tokens identical to float32's
# (docs/quantization.md): a random tiny hybrid stack drifts more than π0.5's trained-like tiny weights.
QWEN35_BOUNDS = {"int8": {"max": 2.5, "mean": 0.1, "tokens": 0.6}, "fp8": {"max": 6.0, "mean": 0.35, "tokens": 0.35}}


@pytest.fixture(scope="module")
def qwen35_small():
    """qwen35_tiny's layer dims at 2 groups of (linear, full) and no vision tower: the scan slices a
    quantized stack over groups, at half the compile of the 8-layer preset."""
    base = qwen35.preset("qwen35_tiny")
    spec = dataclasses.replace(base, backbone=dataclasses.replace(base.backbone, depth=4, vision=None),
                               layer_types=(qwen35.LINEAR, qwen35.FULL) * 2)
    return spec, qwen35.init_decoder(spec, seed=1)


@jax.jit
def _qwen35_logits(spec, dec, ids):
    """Logits [B, T, V] of T tokens fed through `forward_step` (the decode path) from an empty cache."""
    b, t = ids.shape
    x = backbone.embed_tokens(spec.backbone, dec, ids)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    kv = jnp.zeros((len(spec.full_layers), b, t, spec.backbone.num_kv_heads, spec.backbone.head_dim))
    window, state = qwen35.empty_state(spec, b, jnp.float32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    h, _, _ = qwen35.forward_step(spec, dec.layers, x, pos, jnp.ones((b, t), bool), mask, kv, kv, pos, window, state)
    return backbone.lm_logits(spec.backbone, dec, backbone.final_norm(spec.backbone, dec, h))


def test_qwen35_projections_and_mlps_are_quantized_and_the_gates_conv_and_norms_kept(qwen35_small):
    chosen = quant.plan(qwen35_small[1])
    assert set(chosen) == {f"layers/linear/{n}" for n in ("qkv", "z", "out", "gating", "linear")} | \
        {f"layers/full/{n}" for n in ("q", "q_gate", "kv", "out", "gating", "linear")}
    assert chosen["layers/linear/z"].axes == (-3,) and chosen["layers/full/out"].axes == (-3, -2)


def test_quantized_qwen35_is_within_the_documented_bounds_of_float32(qwen35_small):
    spec, dec = qwen35_small
    ids = jnp.asarray(np.random.default_rng(0).integers(4, spec.backbone.vocab_size, (2, 16)), jnp.int32)
    ref = np.asarray(_qwen35_logits(spec, dec, ids))
    rms = np.sqrt(np.mean(ref ** 2))
    for weights in ("int8", "fp8"):
        qdec = quant.quantize_tree(dec, weights)
        # values * scale on the host (the same float32 products): the float program again, nothing compiled
        host = jax.tree.map(lambda x: np.asarray(x.values, np.float32) * np.asarray(x.scale) if isinstance(
            x, quant.QArray) else x, qdec, is_leaf=lambda x: isinstance(x, quant.QArray))
        deq = np.asarray(_qwen35_logits(spec, host, ids))
        if weights == "int8":  # the group scan hands its body dequantized weights: exactly the float program's
            np.testing.assert_array_equal(np.asarray(_qwen35_logits(spec, qdec, ids)), deq)
        err, agree = np.abs(deq - ref) / rms, (deq.argmax(-1) == ref.argmax(-1)).mean()
        bound = QWEN35_BOUNDS[weights]
        assert 0 < err.mean() <= bound["mean"] and err.max() <= bound["max"], (weights, err.max(), err.mean())
        assert bound["tokens"] <= agree, (weights, agree)


# --------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config = model_config("tiny")
    params = init_params(config, 0)
    root = tmp_path_factory.mktemp("quant")
    float_dir = save_params(root / "float", params)
    (root / "tokenizer.model").write_bytes(b"not a real tokenizer")  # copied beside the result, not read
    assert quantize_main(["--ckpt", str(float_dir), "--out", str(root / "int8"), "--weights", "int8"]) == 0
    assert quantize_main(["--ckpt", str(float_dir), "--out", str(root / "fp8"), "--weights", "fp8",
                          "--layers", "mlp", "embed"]) == 0
    # The command reads its source leaf by leaf; restored whole first (as before it streamed), the same output.
    assert not quantize_checkpoint(float_dir, root / "int8_whole", "int8", stream=False)["streamed"]
    return config, params, root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_streamed_quantize_checks_the_digest_of_a_leaf_it_keeps_float(saved, tmp_path):
    # The embedding stays float by default: read in one piece, its digest is checked only after that piece.
    source = _copy(saved[2] / "float", tmp_path / "float")
    meta = source / "checksums" / "metadata"
    text = meta.read_text()
    digest = json.loads(text)["leaves"]["PaliGemma/llm/embedder/input_embedding"]["sha256"]
    meta.write_text(text.replace(digest, "0" * len(digest)))
    with pytest.raises(CheckpointError, match="SHA-256"):
        quantize_checkpoint(source, tmp_path / "int8", "int8")


def test_quantize_command_writes_a_fingerprinted_checkpoint_that_restores_bit_exact(saved):
    config, params, root = saved
    want = quant.quantize_tree(params, "int8")
    got_config, got = restore_params(root / "int8")  # the CPU layout (Unstacked), streamed into it
    assert isinstance(got.vlm.layers, Unstacked) and got_config == config
    assert leaves_equal(stack_layers(got), want)  # values, scales and the float leaves, bit for bit
    assert isinstance(got.vlm.layers.layers[0].q, quant.QArray) and got.vlm.layers.layers[0].q.values.dtype == jnp.int8
    _, mlp_only = restore_params(root / "fp8", config.replace(dtype="bfloat16"))
    mlp_only = stack_layers(mlp_only)
    assert mlp_only.vlm.layers.linear.values.dtype == ml_dtypes.float8_e4m3fn
    assert mlp_only.vlm.layers.linear.scale.dtype == jnp.bfloat16 and mlp_only.vlm.layers.q.dtype == jnp.bfloat16
    want_embed = quant.quantize_tree(params, "fp8", ("embed",)).embedding
    assert isinstance(mlp_only.embedding, quant.QArray) and mlp_only.embedding.scale.shape == want_embed.scale.shape
    np.testing.assert_array_equal(np.asarray(mlp_only.embedding.values).view(np.uint8),
                                  np.asarray(want_embed.values).view(np.uint8))
    # Streamed and restored-whole quantizations are the same arrays, so the same fingerprint.
    assert base_fingerprint(root / "int8_whole") == base_fingerprint(root / "int8")
    assert leaves_equal(stack_layers(restore_params(root / "int8_whole")[1]), want)
    info = quantization_info(root / "int8")
    assert info["weights"] == "int8" and info["provenance"]["source_fingerprint"] == base_fingerprint(root / "float")
    assert quantization_info(root / "float") is None
    fingerprints = {base_fingerprint(root / n) for n in ("float", "int8", "fp8")}
    assert len(fingerprints) == 3 and None not in fingerprints
    assert (root / "int8" / "tokenizer.model").read_bytes() == b"not a real tokenizer"
    loaded = load_model(root / "int8", family="pi05", backend="cpu")  # what run / serve call
    assert isinstance(loaded.params.vlm.layers.layers[0].q, quant.QArray)


def test_vision_heads_on_a_source_that_is_no_lerobot_policy_is_refused_not_ignored(saved, capsys):
    out = saved[2] / "never_written"
    assert quantize_main(["--ckpt", str(saved[2] / "float"), "--out", str(out), "--weights", "int8",
                          "--vision-heads", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--vision-heads sizes the SigLIP of a LeRobot policy" in err and not out.exists()


def test_quantized_checkpoint_is_refused_by_readers_that_know_no_quantization(saved):
    with pytest.raises(ValueError, match="missing"):  # openpi's reader: the quantized leaves are not in params/
        load_openpi_params(saved[2] / "int8")


def test_corrupted_scales_are_refused_in_one_line(tmp_path, saved):
    path = _copy(saved[2] / "int8", tmp_path / "ckpt")
    data = max((path / "quantized" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 64):
        raw[i] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        restore_params(path)
    assert "\n" not in str(e.value) and "quantized" in str(e.value)


def test_scales_of_another_checkpoint_are_refused_in_one_line(tmp_path, saved):
    path = _copy(saved[2] / "int8", tmp_path / "ckpt")
    shutil.rmtree(path / "quantized")
    shutil.copytree(saved[2] / "fp8" / "quantized", path / "quantized")
    with pytest.raises(CheckpointError) as e:
        restore_params(path)
    assert "\n" not in str(e.value) and "damaged" in str(e.value)


@pytest.mark.parametrize("bad", ["shape", "negative", "huge"])
def test_a_scale_that_does_not_fit_its_values_is_refused_in_one_line(tmp_path, bad):
    config = model_config("tiny")
    params = quant.quantize_tree(init_params(config, 0), "int8", ("mlp",))
    q = params.vlm.layers.linear
    scale = {"shape": jnp.ones(q.scale.shape[:-1] + (2,)), "negative": -q.scale, "huge": q.scale * 1e6}[bad]
    layers = params.vlm.layers.__class__(**{**vars(params.vlm.layers), "linear": quant.QArray(q.values, scale)})
    params = params.replace(vlm=params.vlm.__class__(layers=layers, final_norm=params.vlm.final_norm))
    path = save_params(tmp_path / "ckpt", params)  # checksums of the bad scale: only the fit checks can refuse it
    with pytest.raises(CheckpointError, match="mlp/linear") as e:
        restore_params(path)
    assert "\n" not in str(e.value)


def test_an_adapter_loads_on_its_base_quantized_or_float_and_on_no_other(saved, tmp_path):
    from oxygen_jax.ckpts.adapters import load_adapter, save_adapter
    from oxygen_jax.models.pi05 import lora as pi05_lora

    config, _, root = saved
    adapter = pi05_lora.init_bank(config, 1, rank=2, seed=3).adapter(1)
    on_float = save_adapter(tmp_path / "on_float", adapter, prompt="Memory: ", base=root / "float")
    on_int8 = save_adapter(tmp_path / "on_int8", adapter, prompt="Memory: ", base=root / "int8")
    with pytest.warns(UserWarning, match=r"trained on the float base .* loaded on its int8 quantization") as w:
        got, _ = load_adapter(on_float, config, base=root / "int8")
    assert len(w) == 1 and "\n" not in str(w[0].message) and leaves_equal(got, adapter)
    with pytest.warns(UserWarning, match=r"trained on the int8 base .* loaded on the float base it was quantized from"):
        load_adapter(on_int8, config, base=root / "float")
    # Any other mismatch is refused: a sibling quantization (fp8 of the same source) is not the base either.
    with pytest.raises(ValueError, match="holds other weights"):
        load_adapter(on_int8, config, base=root / "fp8")
    with pytest.raises(ValueError, match="holds other weights"):
        load_adapter(on_float, config, base=save_params(tmp_path / "other", init_params(config, 1)))


def test_tensor_parallel_rules_split_values_like_the_weight_and_scales_only_on_kept_output_channels(tiny):
    from jax.sharding import PartitionSpec as P

    from oxygen_jax.models.partition import param_specs

    params = stack_layers(tiny[1])
    qparams = quant.quantize_tree(params, "int8")
    is_q = lambda x: isinstance(x, quant.QArray)  # noqa: E731
    float_specs = jax.tree.leaves(param_specs(params, "model", 2), is_leaf=lambda x: isinstance(x, P))
    q_specs = jax.tree.leaves(param_specs(qparams, "model", 2), is_leaf=lambda x: is_q(x) or isinstance(x, P))
    split = 0
    for want, got, leaf in zip(float_specs, q_specs, jax.tree.leaves(qparams, is_leaf=is_q), strict=True):
        if not is_q(leaf):
            assert got == want
            continue
        assert got.values == want  # the int8 values split like the float weight
        kept = [None if s is None or leaf.scale.shape[i] == 1 else s for i, s in enumerate(want)]
        assert got.scale == (P(*kept) if any(kept) else P())  # split where it keeps the output channel, else whole
        split += any(want)
    assert split and qparams.vlm.layers.q.scale.shape[1] > 1 and qparams.vlm.layers.linear.scale.shape[1] == 1
    dyn = quant.with_matmul(qparams, "int8")  # the matmul mode is part of the tree: specs keep it
    assert jax.tree.structure(param_specs(dyn, "model", 2)) == jax.tree.structure(dyn)


def test_an_adapter_trains_on_a_quantized_base_with_its_embedding_quantized_and_the_base_untouched(saved, tmp_path):
    """QLoRA-style: the fp8 base (MLPs and the embedding / tied LM head quantized) stays bit for bit, the float
    adapter learns (loss down over a few steps on one batch), and loads on the float base it was quantized from."""
    from oxygen_jax.ckpts.adapters import load_adapter, save_adapter
    from oxygen_jax.models.pi05.params import for_backend
    from oxygen_jax.robots.config import robot_config
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer
    from training.data.synthetic_memory import SyntheticMemoryConfig, synthetic_splits
    from training.memory.config import TrainConfig
    from training.memory.data import TextTask
    from training.memory.loop import train

    config, _, root = saved
    _, base = restore_params(root / "fp8")
    base = for_backend(base)
    assert isinstance(base.embedding, quant.QArray)
    frames = synthetic_splits(SyntheticMemoryConfig(image_size=config.siglip.image_size, num_inits=3,
                                                    num_train_inits=2))["train"][:2]
    task = TextTask(robot=robot_config("libero", max_token_len=32), tokenizer=train_demo_tokenizer(),
                    prompt="Memory: ", label_key="memory", suffix_len=24)
    cfg = TrainConfig(steps=6, batch_size=2, suffix_len=24, rank=2, peak_lr=3e-2, final_lr=3e-2, warmup_steps=1,
                      augment=False)
    before = jax.tree.map(np.asarray, base)
    result = train(cfg, base, task, frames, log_every=1)
    losses = [h["loss"] for h in result.history if h["event"] == "train"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert leaves_equal(before, base)  # the quantized values and scales never move
    adapter = jax.device_get(result.state.trainable.adapter(1))
    assert all(np.asarray(x).dtype == np.float32 for x in jax.tree.leaves(adapter))
    path = save_adapter(tmp_path / "adapter", adapter, prompt="Memory: ", base=root / "fp8")
    with pytest.warns(UserWarning, match=r"trained on the fp8 base .* loaded on the float base it was quantized from"):
        got, _ = load_adapter(path, config, base=root / "float")
    assert leaves_equal(got, adapter)


def test_an_openpi_checkpoint_with_lora_streams_merged_to_the_same_arrays_as_the_whole_restore(tmp_path):
    """LoRA on both experts (attention and MLP ranks differ), openpi's training layout (frozen leaves bfloat16, a
    `value` level), merged layer by layer as the leaves stream: the same quantized arrays, so the same fingerprint,
    as restoring the stacked checkpoint and merging whole stacks first."""
    from oxygen_jax.models.pi05 import lora as pi05_lora
    from test_lora import _bf16_exact, _random_b, _write_lora_checkpoint

    params = _bf16_exact(init_params(model_config("tiny"), 2))  # stored exactly by the training layout
    cfg = params.config
    attn = _random_b(pi05_lora.init_bank(cfg, 1, rank=3, targets=("q", "kv", "out"), seed=4), 5).adapter(1)
    ffn = _random_b(pi05_lora.init_bank(cfg, 1, rank=3, targets=("gating", "linear"), seed=6), 7).adapter(1)
    act = _random_b(pi05_lora.init_bank(cfg.action_expert, 1, rank=2, seed=8), 9).adapter(1)
    adapters = pi05_lora.ModelLora(vlm=attn.replace(gating=ffn.gating, linear=ffn.linear), action_expert=act)
    src = _write_lora_checkpoint(tmp_path / "params", params, adapters, training_layout=True)
    streamed = quantize_checkpoint(src, tmp_path / "streamed", "int8")
    whole = quantize_checkpoint(src, tmp_path / "whole", "int8", stream=False)
    assert streamed["streamed"] and not whole["streamed"]
    assert base_fingerprint(tmp_path / "streamed") == base_fingerprint(tmp_path / "whole")
    got = stack_layers(restore_params(tmp_path / "streamed")[1])
    want = quant.quantize_tree(pi05_lora.merge(params, adapters), "int8")
    for field in ("vlm", "action_expert"):  # merged, not dropped: the quantization of the merged weights
        assert leaves_equal(getattr(got, field).layers.q, getattr(want, field).layers.q), field
