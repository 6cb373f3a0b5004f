"""Normalisation statistics: openpi norm_stats.json I/O and the quantile / z-score normalisers."""

import json

import numpy as np
import pytest

from oxygen_jax.robots.normalize import (
    NormStats, load_norm_stats, quantile_normalize, quantile_unnormalize, save_norm_stats, zscore_normalize, zscore_unnormalize,
)


@pytest.fixture
def stats() -> NormStats:
    return NormStats.create(mean=[0.0, 1.0, 2.0], std=[1.0, 2.0, 4.0], q01=[-1.0, 0.0, 10.0], q99=[1.0, 2.0, 20.0])


# --- quantile -------------------------------------------------------------------------------------


def test_quantile_normalize_maps_q01_to_minus_one_and_q99_to_one(stats):
    y = quantile_normalize(np.array([[-1.0, 0.0, 10.0], [1.0, 2.0, 20.0]]), stats)
    np.testing.assert_allclose(y, [[-1, -1, -1], [1, 1, 1]], atol=1e-5)


def test_quantile_normalize_does_not_clip(stats):
    y = quantile_normalize(np.array([3.0, -2.0, 30.0]), stats)
    np.testing.assert_allclose(y, [3.0, -3.0, 3.0], atol=1e-5)


def test_quantile_normalize_uses_the_stats_formula_with_epsilon(stats):
    x = np.array([0.5, 1.5, 12.0])
    expected = (x - stats.q01) / (stats.q99 - stats.q01 + 1e-6) * 2 - 1
    np.testing.assert_array_equal(quantile_normalize(x, stats), expected)


def test_quantile_normalize_then_unnormalize_is_identity(stats):
    x = np.random.default_rng(0).normal(size=(4, 5, 3)) * 10
    np.testing.assert_allclose(quantile_unnormalize(quantile_normalize(x, stats), stats), x, atol=1e-12)


def test_quantile_unnormalize_passes_padded_dims_through(stats):
    y = np.random.default_rng(1).normal(size=(2, 5, 32)).astype(np.float32)
    out = quantile_unnormalize(y, stats)
    assert out.shape == y.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out[..., 3:], y[..., 3:])
    expected = (y[..., :3] + 1) / 2 * (stats.q99 - stats.q01 + 1e-6) + stats.q01
    np.testing.assert_allclose(out[..., :3], expected, rtol=1e-6)


def test_quantile_normalize_slices_stats_to_the_input_dim(stats):
    np.testing.assert_allclose(quantile_normalize(np.array([1.0, 0.0]), stats), [1.0, -1.0], atol=1e-5)


def test_quantile_normalize_rejects_more_dims_than_the_stats(stats):
    with pytest.raises(ValueError, match="last dim 4.*only have 3 dims"):
        quantile_normalize(np.zeros(4), stats)


def test_quantile_normalisers_require_q01_and_q99():
    old = NormStats.create(mean=[0.0], std=[1.0])
    with pytest.raises(ValueError, match="q01 and q99"):
        quantile_normalize(np.zeros(1), old)
    with pytest.raises(ValueError, match="q01 and q99"):
        quantile_unnormalize(np.zeros(1), old)


def test_normalisers_keep_float32_and_promote_integers_to_float32(stats):
    assert quantile_normalize(np.zeros(3, np.float32), stats).dtype == np.float32
    assert quantile_normalize(np.zeros(3, np.int64), stats).dtype == np.float32


# --- z-score (π0) ---------------------------------------------------------------------------------


def test_zscore_round_trip_and_padded_dims_pass_through(stats):
    x = np.array([[1.0, 3.0, 6.0]])
    np.testing.assert_allclose(zscore_normalize(x, stats), [[1.0, 1.0, 1.0]], atol=1e-5)
    y = np.concatenate([zscore_normalize(x, stats), [[7.0, 8.0]]], axis=-1)
    np.testing.assert_allclose(zscore_unnormalize(y, stats), [[1.0, 3.0, 6.0, 7.0, 8.0]], atol=1e-12)


# --- norm_stats.json ------------------------------------------------------------------------------


def test_norm_stats_json_save_then_load_is_exact(tmp_path, stats):
    path = tmp_path / "assets" / "droid" / "norm_stats.json"
    old = NormStats.create(mean=[0.1, 0.2], std=[0.3, 0.4])
    save_norm_stats(path, {"state": stats, "actions": old})
    loaded = load_norm_stats(path)
    assert set(loaded) == {"state", "actions"}
    for f in ("mean", "std", "q01", "q99"):
        np.testing.assert_array_equal(getattr(loaded["state"], f), getattr(stats, f))
    assert loaded["actions"].q01 is None and loaded["actions"].q99 is None
    assert load_norm_stats(path.parent)["state"].dim == 3  # a directory resolves to its norm_stats.json


def test_load_reads_the_openpi_layout(tmp_path):
    path = tmp_path / "norm_stats.json"
    body = {"mean": [1, 2], "std": [1, 1], "q01": [0, 0], "q99": [2, 4]}
    path.write_text(json.dumps({"norm_stats": {"state": body, "actions": body}}))
    stats = load_norm_stats(path)
    assert stats["state"].q99.tolist() == [2.0, 4.0] and stats["actions"].mean.dtype == np.float64


def _write(tmp_path, obj) -> str:
    path = tmp_path / "norm_stats.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ({"state": {"mean": [0], "std": [1]}}, "top-level object"),
        ({"norm_stats": {"state": {"mean": [0.0]}}}, "'state'.* lacks 'std'"),
        ({"norm_stats": {"actions": {"std": [1.0]}}}, "'actions'.* lacks 'mean'"),
        ({"norm_stats": {"state": {"mean": [0.0], "std": [1.0], "q01": [0.0, 1.0], "q99": [1.0]}}}, "'state'.*q01"),
        ({"norm_stats": {"state": {"mean": ["a"], "std": [1.0]}}}, "'state'.*malformed"),
        ("{not json", "not valid JSON"),
    ],
)
def test_load_errors_name_the_file_and_the_bad_key(tmp_path, content, message):
    path = _write(tmp_path, content)
    with pytest.raises(ValueError, match=message) as e:
        load_norm_stats(path)
    assert path in str(e.value)


def test_load_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_norm_stats(tmp_path / "nope.json")


def test_norm_stats_constructor_rejects_lists_and_points_to_create():
    with pytest.raises(ValueError, match="NormStats.create"):
        NormStats(mean=[0.0], std=[1.0])
