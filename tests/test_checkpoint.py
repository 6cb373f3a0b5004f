"""Checkpoint tests: openpi restore (both layouts), config inference, manifests, own round trip."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from oxygen_jax import checkpoint as ckpt
from oxygen_jax.config import model_config
from oxygen_jax.params import OPENPI_PATHS, abstract_params, init_params, openpi_shapes, to_openpi_dict

_REPO = Path(__file__).resolve().parents[1]


def _shared_fixtures() -> Path:
    shared = os.environ.get("OXYGEN_SHARED_DIR")
    return (Path(shared) if shared else _REPO.parent / "shared").resolve() / "fixtures"


def _fixture(*parts: str) -> Path:
    path = _shared_fixtures().joinpath(*parts)
    if not path.exists():
        pytest.skip(f"../shared fixtures not present: {path}")
    return path


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    same = lambda x, y: x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))  # noqa: E731
    return len(la) == len(lb) and all(same(x, y) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def tiny():
    config = model_config("tiny")
    return config, init_params(config, jax.random.key(0))


def _write_openpi(path: Path, flat: dict, *, value_suffix: bool = False) -> Path:
    """Writes `{"params": nested}` the way openpi does (training layout: every leaf under `value`)."""
    tree: dict = {}
    for key, leaf in flat.items():
        node = tree
        parts = key.split("/") + (["value"] if value_suffix else [])
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = leaf
    ocp.PyTreeCheckpointer().save(path.resolve(), {"params": tree})
    return path


# --------------------------------------------------------------------------------------------
# Config inference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "bench", "pi05"])
def test_infer_model_config_inverts_openpi_shapes(preset):
    config = model_config(preset)
    assert ckpt.infer_model_config(openpi_shapes(config)) == config
    assert ckpt.infer_model_config(openpi_shapes(config), dtype="bfloat16").dtype == "bfloat16"


def test_infer_names_missing_key():
    shapes = openpi_shapes(model_config("tiny"))
    del shapes["PaliGemma/img/pos_embedding"]
    with pytest.raises(ValueError, match="PaliGemma/img/pos_embedding"):
        ckpt.infer_model_config(shapes)


def test_infer_rejects_siglip_head_dim_that_config_cannot_represent():
    shapes = openpi_shapes(model_config("tiny"))  # SigLIP width 32, 2 heads of 16
    key = "PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/query/kernel"
    shapes[key] = (1, 32, 2, 8)
    with pytest.raises(ValueError, match="head_dim") as e:
        ckpt.infer_model_config(shapes)
    assert key in str(e.value)


def test_infer_rejects_experts_with_different_depth():
    shapes = openpi_shapes(model_config("tiny"))
    key = "PaliGemma/llm/layers/attn/q_einsum_1/w"
    shapes[key] = (3,) + shapes[key][1:]
    with pytest.raises(ValueError, match="depth") as e:
        ckpt.infer_model_config(shapes)
    assert key in str(e.value)


# --------------------------------------------------------------------------------------------
# The shared openpi fixture (released and training layouts)
# --------------------------------------------------------------------------------------------

_FIXTURE_LAYOUTS = ["params", "train_checkpoint/1/params", "train_checkpoint/1", "."]


@pytest.fixture(scope="module")
def fixture_reference():
    return ckpt.load_openpi_params(_fixture("openpi_tiny_pi05", "params"))


@pytest.mark.parametrize("layout", _FIXTURE_LAYOUTS)
def test_openpi_fixture_layouts_restore_identical_arrays(layout, fixture_reference):
    ref_config, ref_params = fixture_reference
    config, params = ckpt.load_openpi_params(_fixture("openpi_tiny_pi05", *layout.split("/")))
    assert config == ref_config
    assert _leaves_equal(params, ref_params)
    assert len(jax.tree.leaves(params)) == 51


def test_openpi_fixture_inferred_config(fixture_reference):
    config, params = fixture_reference
    vlm, act, sig = config.vlm, config.action_expert, config.siglip
    assert (vlm.width, vlm.depth, vlm.mlp_dim, vlm.num_heads, vlm.num_kv_heads, vlm.head_dim) == (64, 3, 128, 4, 1, 16)
    assert (act.width, act.depth, act.mlp_dim, act.num_heads, act.num_kv_heads, act.head_dim) == (32, 3, 96, 4, 1, 16)
    assert config.vocab_size == 1024 and config.action_dim == 32
    assert (sig.width, sig.depth, sig.mlp_dim, sig.num_heads, sig.head_dim) == (32, 2, 64, 2, 16)
    assert (sig.patch_size, sig.image_size, sig.num_patches) == (14, 224, 256)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == 286144


def test_openpi_fixture_restores_as_bfloat16(fixture_reference):
    _, ref = fixture_reference
    config, params = ckpt.load_openpi_params(_fixture("openpi_tiny_pi05", "train_checkpoint", "1"), dtype="bfloat16")
    assert config.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
    expected = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), ref)
    assert _leaves_equal(params, expected)


def test_openpi_fixture_has_no_norm_stats():
    assert ckpt.load_openpi_norm_stats(_fixture("openpi_tiny_pi05")) is None


# --------------------------------------------------------------------------------------------
# Parameter manifests (full size, no allocation)
# --------------------------------------------------------------------------------------------


def test_full_size_manifest_maps_exactly_onto_pi05_tree():
    path = _fixture("pi05_param_manifest.json")
    result = ckpt.check_manifest(path)
    assert result.ok, result.summary()
    assert result.matches_preset, result.summary()
    assert result.config == model_config("pi05")
    # Independently: the eval_shape tree of the preset has exactly the manifest's leaves.
    leaves = json.loads(path.read_text())["leaves"]
    tree = to_openpi_dict(abstract_params(model_config("pi05")))
    assert {k: tuple(v.shape) for k, v in tree.items()} == {k: tuple(v["shape"]) for k, v in leaves.items()}


def test_lora_manifest_reports_unsupported_lora_leaves():
    path = _fixture("pi05_lora_param_manifest.json")
    result = ckpt.check_manifest(path)
    assert not result.ok
    assert len(result.lora) == 20 and all(r.note == "unsupported LoRA leaf" and not r.ok for r in result.lora)
    assert not result.missing and not result.misshaped and not result.unexpected
    assert "unsupported LoRA leaf" in result.summary()
    tolerant = ckpt.check_manifest(path, allow_lora=True)
    assert tolerant.ok and tolerant.matches_preset and len(tolerant.lora) == 20


def test_manifest_reports_mismatch_against_given_config(tmp_path):
    shapes = openpi_shapes(model_config("tiny"))
    shapes["action_out_proj/bias"] = (31,)
    del shapes["time_mlp_in/kernel"]
    shapes["something/else"] = (2,)
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"leaves": {k: {"shape": list(s), "dtype": "float32"} for k, s in shapes.items()}}))
    result = ckpt.check_manifest(manifest, model_config("tiny"), preset=None)
    assert [r.path for r in result.misshaped] == ["action_out_proj/bias"]
    assert result.misshaped[0].expected == (32,) and result.misshaped[0].got == (31,)
    assert [r.path for r in result.missing] == ["time_mlp_in/kernel"]
    assert [r.path for r in result.unexpected] == ["something/else"]
    assert result.preset is None and not result.matches_preset


# --------------------------------------------------------------------------------------------
# Our own checkpoints
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_own_checkpoint_round_trip_is_bit_exact(tmp_path, tiny, dtype):
    config, params = tiny
    if dtype != config.dtype:
        config = config.replace(dtype=dtype)
        params = init_params(config, jax.random.key(0))
    ckpt.save_params(tmp_path / "ckpt", params, config)
    restored_config, restored = ckpt.restore_params(tmp_path / "ckpt")
    assert restored_config == config
    assert _leaves_equal(restored, params)
    assert {leaf.dtype for leaf in jax.tree.leaves(restored)} == {jnp.dtype(dtype)}


def test_own_checkpoint_dtype_comes_from_target_config(tmp_path, tiny):
    config, params = tiny
    ckpt.save_params(tmp_path / "ckpt", params)
    bf16 = config.replace(dtype="bfloat16")
    _, restored = ckpt.restore_params(tmp_path / "ckpt", bf16)
    expected = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert _leaves_equal(restored, expected)
    with pytest.raises(ValueError, match="differ"):
        ckpt.restore_params(tmp_path / "ckpt", model_config("bench"))


def test_own_checkpoint_refuses_to_overwrite_and_is_openpi_readable(tmp_path, tiny):
    config, params = tiny
    path = ckpt.save_params(tmp_path / "ckpt", params, config)
    with pytest.raises(FileExistsError):
        ckpt.save_params(path, params, config)
    ckpt.save_params(path, params, config, overwrite=True)
    openpi_config, openpi_params = ckpt.load_openpi_params(path)
    assert openpi_config == config and _leaves_equal(openpi_params, params)


# --------------------------------------------------------------------------------------------
# openpi-style checkpoints written here: error reporting
# --------------------------------------------------------------------------------------------


@pytest.fixture()
def tiny_flat(tiny):
    return dict(to_openpi_dict(tiny[1]))


@pytest.mark.parametrize("value_suffix", [False, True])
def test_openpi_checkpoint_round_trip(tmp_path, tiny, tiny_flat, value_suffix):
    _write_openpi(tmp_path / "params", tiny_flat, value_suffix=value_suffix)
    for path in (tmp_path / "params", tmp_path):  # the item, and the step dir containing it
        config, params = ckpt.load_openpi_params(path)
        assert config == tiny[0]
        assert _leaves_equal(params, tiny[1])


# One key that inference reads, one it does not: both must be named.
@pytest.mark.parametrize(
    "key", ["PaliGemma/llm/layers/attn/q_einsum_1/w", "PaliGemma/llm/layers/mlp_1/linear"]
)
def test_openpi_missing_key_is_named(tmp_path, tiny_flat, key):
    del tiny_flat[key]
    _write_openpi(tmp_path / "params", tiny_flat)
    with pytest.raises(ValueError, match="missing") as e:
        ckpt.load_openpi_params(tmp_path / "params")
    assert key in str(e.value)


def test_openpi_misshaped_key_names_key_and_both_shapes(tmp_path, tiny_flat):
    key = "time_mlp_in/bias"
    tiny_flat[key] = jnp.zeros((33,), jnp.float32)
    _write_openpi(tmp_path / "params", tiny_flat)
    with pytest.raises(ValueError) as e:
        ckpt.load_openpi_params(tmp_path / "params")
    assert f"{key}: expected (32,), got (33,)" in str(e.value)


def test_openpi_extra_keys_are_ignored(tmp_path, tiny, tiny_flat):
    tiny_flat["some_head/kernel"] = jnp.ones((3, 5))
    _write_openpi(tmp_path / "params", tiny_flat, value_suffix=True)
    config, params = ckpt.load_openpi_params(tmp_path / "params")
    assert config == tiny[0] and _leaves_equal(params, tiny[1])


def test_openpi_lora_leaves_are_ignored_with_a_warning(tmp_path, tiny, tiny_flat):
    tiny_flat["PaliGemma/llm/layers/attn/q_einsum/lora_a"] = jnp.ones((2, 4, 64, 4))
    _write_openpi(tmp_path / "params", tiny_flat)
    with pytest.warns(UserWarning, match="LoRA"):
        _, params = ckpt.load_openpi_params(tmp_path / "params")
    assert _leaves_equal(params, tiny[1])


def test_openpi_dtype_argument_is_honoured(tmp_path, tiny_flat):
    _write_openpi(tmp_path / "params", tiny_flat)
    config, params = ckpt.load_openpi_params(tmp_path / "params", dtype="bfloat16", prompt_attention="causal")
    assert (config.dtype, config.prompt_attention) == ("bfloat16", "causal")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}


def test_bad_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.load_openpi_params(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not an orbax checkpoint"):
        ckpt.load_openpi_params(tmp_path / "empty")
    step = tmp_path / "step"
    (step / "train_state").mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(ValueError, match="no 'params' item"):
        ckpt.load_openpi_params(step)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.restore_params(tmp_path / "nope")


def test_openpi_tree_without_params_entry_is_rejected(tmp_path):
    ocp.PyTreeCheckpointer().save((tmp_path / "params").resolve(), {"weights": {"w": np.zeros(3, np.float32)}})
    with pytest.raises(ValueError, match="no 'params' entry"):
        ckpt.load_openpi_params(tmp_path / "params")


# --------------------------------------------------------------------------------------------
# Norm stats
# --------------------------------------------------------------------------------------------


def _write_norm_stats(root: Path, asset_id: str, dim: int) -> None:
    entry = {"mean": [0.0] * dim, "std": [1.0] * dim, "q01": [-1.0] * dim, "q99": [1.0] * dim}
    stats = {"state": entry, "actions": entry}
    path = root / "assets" / asset_id / "norm_stats.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"norm_stats": stats}))


def test_norm_stats_found_beside_params(tmp_path):
    _write_norm_stats(tmp_path, "physical-intelligence/libero", 8)
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "_METADATA").write_text("{}")
    for path in (tmp_path, tmp_path / "params"):
        stats = ckpt.load_openpi_norm_stats(path)
        assert set(stats) == {"state", "actions"}
        np.testing.assert_array_equal(stats["actions"].q99, np.ones(8))
    _write_norm_stats(tmp_path, "droid", 7)
    with pytest.raises(ValueError, match="asset_id"):
        ckpt.load_openpi_norm_stats(tmp_path)
    assert ckpt.load_openpi_norm_stats(tmp_path, "droid")["state"].dim == 7
    with pytest.raises(FileNotFoundError, match="aloha"):
        ckpt.load_openpi_norm_stats(tmp_path, "aloha")


def test_every_openpi_path_is_checked_by_the_manifest_rows():
    rows = ckpt.check_manifest(_fixture("pi05_param_manifest.json")).rows
    assert [r.path for r in rows] == list(OPENPI_PATHS)
