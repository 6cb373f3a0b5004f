"""`nn.torch_order`: float32 results equal torch's CPU kernels bit for bit (torch's outputs stored in
tests/data/qwen35_refs/torch_primitives.npz by `eval/refs/qwen35_refs.py --primitives`; no torch needed here),
and the orderings it promises hold for any size (checked against numpy emulations)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxygen_jax.nn import torch_order as to

_DATA = Path(__file__).parent / "data" / "qwen35_refs" / "torch_primitives.npz"


@pytest.fixture(scope="module")
def torch_results():
    return dict(np.load(_DATA))


def _bits_equal(ours, theirs):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape
    differ = int(np.sum(ours.view(np.int32) != theirs.view(np.int32)))
    assert differ == 0, f"{differ} of {ours.size} values differ from torch's"


def test_row_sum_and_mean_are_torchs_for_every_length(torch_results):
    lengths = sorted(int(k[5:]) for k in torch_results if k.startswith("sum_x"))
    assert lengths[0] < 8 and lengths[-1] >= 520  # scalar path, vector path and torch's cascade
    for n in lengths:
        x = torch_results[f"sum_x{n}"]
        _bits_equal(jax.jit(to.row_sum)(x), torch_results[f"sum_{n}"])
        _bits_equal(jax.jit(lambda v: to.row_mean(to.separate(v * v)))(x), torch_results[f"mean_{n}"])


def test_rsqrt_cumsum_l2norm_and_rms_norm_are_torchs(torch_results):
    r = torch_results
    _bits_equal(jax.jit(to.rsqrt)(r["rsqrt_x"]), r["rsqrt"])
    _bits_equal(jax.jit(to.cumsum)(r["cumsum_x"]), r["cumsum"])
    _bits_equal(jax.jit(to.l2_normalize)(r["l2norm_x"]), r["l2norm"])
    rms = jax.jit(lambda x, w: to.rms_norm(x, w, 1e-6, plus_one=True))
    _bits_equal(rms(r["rmsnorm_x"], r["rmsnorm_w"]), r["rmsnorm"])


def test_dense_and_matmul_are_torchs_linear_and_matmul(torch_results):
    r = torch_results
    shapes = [k[len("linear_x"):] for k in r if k.startswith("linear_x")]
    assert any(int(s.split("_")[1]) % 64 for s in shapes)  # widths XLA would otherwise sum its own way
    for s in shapes:
        x, w = r[f"linear_x{s}"], r[f"linear_w{s}"]
        _bits_equal(jax.jit(to.dense)(x, w.T), r[f"linear_{s}"])
    _bits_equal(jax.jit(to.matmul)(r["matmul_a"], r["matmul_b"]), r["matmul"])


def _sequential_fma(x, w):
    """x [M, K] @ w [K, N] as float32 accumulations of exact products, k = 0, 1, ... (float64 holds each
    product and sum of two float32 terms exactly, so rounding the float64 sum is one fused multiply-add)."""
    acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for k in range(x.shape[1]):
        acc = (acc.astype(np.float64) + x[:, k:k + 1].astype(np.float64) * w[k].astype(np.float64)).astype(np.float32)
    return acc


@pytest.mark.parametrize("k, n", [(24, 5), (48, 40), (72, 130)])
def test_dense_sums_each_output_in_order_with_fused_multiply_adds(k, n):
    rng = np.random.default_rng(k + n)
    x = rng.standard_normal((12, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    _bits_equal(jax.jit(to.dense)(x, w), _sequential_fma(x, w))


def test_cumsum_rounds_each_exact_prefix_sum_once():
    x = jnp.asarray(np.random.default_rng(0).uniform(-3.0, 0.0, (4, 200)), jnp.float32)
    exact = np.cumsum(np.asarray(x, np.float64), axis=-1)
    _bits_equal(jax.jit(to.cumsum)(x), exact.astype(np.float32))
    assert np.any(np.asarray(jnp.cumsum(x, axis=-1)) != exact.astype(np.float32))  # XLA's own scan does not


def test_divide_is_a_true_division_and_softplus_switches_at_20():
    x = jnp.asarray(np.random.default_rng(1).standard_normal(4096), jnp.float32)
    _bits_equal(jax.jit(lambda v: to.divide(v, 48.0))(x), np.asarray(x) / np.float32(48.0))
    big = jnp.asarray([19.0, 21.0, 100.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(to.softplus(big))[1:], [21.0, 100.0])
    assert np.isfinite(np.asarray(to.softplus(big))).all()


def test_separate_rounds_a_product_before_the_add():
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal(20000).astype(np.float32) for _ in range(3))
    ours = jax.jit(lambda a, b, c: to.separate(a * b) + c)(a, b, c)
    _bits_equal(ours, (a * b).astype(np.float32) + c)  # numpy rounds the product, then the sum
    assert np.isnan(np.asarray(to.separate(jnp.asarray([np.nan], jnp.float32)))).all()
