"""Checkpoint tests: openpi restore (both layouts), config inference, manifests, own round trip."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import fixture, leaves_equal, write_norm_stats
from oxygen_jax.ckpts.manifest import check_manifest
from oxygen_jax.ckpts.openpi import infer_model_config, load_openpi_norm_stats, load_openpi_params
from oxygen_jax.ckpts.orbax_io import CheckpointError
from oxygen_jax.ckpts.own import restore_params, save_params
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import OPENPI_PATHS, abstract_params, init_params, openpi_shapes, to_openpi_dict

_fixture = fixture  # a path inside ../shared/fixtures, or a visible skip


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
    assert infer_model_config(openpi_shapes(config)) == config
    assert infer_model_config(openpi_shapes(config), dtype="bfloat16").dtype == "bfloat16"


def test_infer_names_missing_key():
    shapes = openpi_shapes(model_config("tiny"))
    del shapes["PaliGemma/img/pos_embedding"]
    with pytest.raises(ValueError, match="PaliGemma/img/pos_embedding"):
        infer_model_config(shapes)


def test_infer_rejects_siglip_head_dim_that_config_cannot_represent():
    shapes = openpi_shapes(model_config("tiny"))  # SigLIP width 32, 2 heads of 16
    key = "PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/query/kernel"
    shapes[key] = (1, 32, 2, 8)
    with pytest.raises(ValueError, match="head_dim") as e:
        infer_model_config(shapes)
    assert key in str(e.value)


def test_infer_rejects_experts_with_different_depth():
    shapes = openpi_shapes(model_config("tiny"))
    key = "PaliGemma/llm/layers/attn/q_einsum_1/w"
    shapes[key] = (3,) + shapes[key][1:]
    with pytest.raises(ValueError, match="depth") as e:
        infer_model_config(shapes)
    assert key in str(e.value)


# --------------------------------------------------------------------------------------------
# The shared openpi fixture (released and training layouts)
# --------------------------------------------------------------------------------------------

_FIXTURE_LAYOUTS = ["params", "train_checkpoint/1/params", "train_checkpoint/1", "."]


@pytest.fixture(scope="module")
def fixture_reference():
    return load_openpi_params(_fixture("openpi_tiny_pi05", "params"), layout="stacked")


@pytest.mark.parametrize("layout", _FIXTURE_LAYOUTS)
def test_openpi_fixture_layouts_restore_identical_arrays(layout, fixture_reference):
    ref_config, ref_params = fixture_reference
    config, params = load_openpi_params(_fixture("openpi_tiny_pi05", *layout.split("/")), layout="stacked")
    assert config == ref_config
    assert leaves_equal(params, ref_params)
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
    config, params = load_openpi_params(_fixture("openpi_tiny_pi05", "train_checkpoint", "1"), dtype="bfloat16", layout="stacked")
    assert config.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
    expected = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), ref)
    assert leaves_equal(params, expected)


def test_openpi_fixture_has_no_norm_stats():
    assert load_openpi_norm_stats(_fixture("openpi_tiny_pi05")) is None


# --------------------------------------------------------------------------------------------
# Parameter manifests (full size, no allocation)
# --------------------------------------------------------------------------------------------


def test_full_size_manifest_maps_exactly_onto_pi05_tree():
    path = _fixture("pi05_param_manifest.json")
    result = check_manifest(path)
    assert result.ok, result.summary()
    assert result.matches_preset, result.summary()
    assert result.config == model_config("pi05")
    # Independently: the eval_shape tree of the preset has exactly the manifest's leaves.
    leaves = json.loads(path.read_text())["leaves"]
    tree = to_openpi_dict(abstract_params(model_config("pi05")))
    assert {k: tuple(v.shape) for k, v in tree.items()} == {k: tuple(v["shape"]) for k, v in leaves.items()}


def test_lora_manifest_checks_every_lora_leaf_against_its_expert_and_rank(tmp_path):
    path = _fixture("pi05_lora_param_manifest.json")
    result = check_manifest(path)
    assert result.ok and result.matches_preset, result.summary()
    assert len(result.lora) == 20 and all(r.note == "LoRA leaf" for r in result.lora)
    ranks = {r.path: r.got[-1] for r in result.lora if r.path.endswith("lora_a")}
    assert ranks["PaliGemma/llm/layers/attn/q_einsum/lora_a"] == 16  # gemma_2b_lora
    assert ranks["PaliGemma/llm/layers/attn/q_einsum_1/lora_a"] == 32  # gemma_300m_lora
    # A factor of the wrong rank and a path openpi never writes are both reported.
    leaves = json.loads(path.read_text())["leaves"]
    leaves["PaliGemma/llm/layers/mlp/linear_lora_b"]["shape"] = [18, 8, 2048]
    leaves["PaliGemma/llm/layers/attn/extra_lora_a"] = {"shape": [1], "dtype": "float32"}
    damaged = tmp_path / "manifest.json"
    damaged.write_text(json.dumps({"leaves": leaves}))
    result = check_manifest(damaged)
    notes = {r.path: r.note for r in result.rows if not r.ok}
    assert notes == {
        "PaliGemma/llm/layers/mlp/linear_lora_b": "mis-shaped LoRA leaf",
        "PaliGemma/llm/layers/attn/extra_lora_a": "unknown LoRA leaf",
    }
    row = next(r for r in result.rows if r.path == "PaliGemma/llm/layers/mlp/linear_lora_b")
    assert row.expected == (18, 16, 2048) and row.got == (18, 8, 2048)


def test_manifest_reports_mismatch_against_given_config(tmp_path):
    shapes = openpi_shapes(model_config("tiny"))
    shapes["action_out_proj/bias"] = (31,)
    del shapes["time_mlp_in/kernel"]
    shapes["something/else"] = (2,)
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"leaves": {k: {"shape": list(s), "dtype": "float32"} for k, s in shapes.items()}}))
    result = check_manifest(manifest, model_config("tiny"), preset=None)
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
    save_params(tmp_path / "ckpt", params, config)
    restored_config, restored = restore_params(tmp_path / "ckpt")
    assert restored_config == config
    assert leaves_equal(restored, params)
    assert {leaf.dtype for leaf in jax.tree.leaves(restored)} == {jnp.dtype(dtype)}


def test_own_checkpoint_dtype_comes_from_target_config(tmp_path, tiny):
    config, params = tiny
    save_params(tmp_path / "ckpt", params)
    bf16 = config.replace(dtype="bfloat16")
    _, restored = restore_params(tmp_path / "ckpt", bf16)
    expected = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), params)
    assert leaves_equal(restored, expected)
    with pytest.raises(ValueError, match="differ"):
        restore_params(tmp_path / "ckpt", model_config("bench"))


def test_own_checkpoint_refuses_to_overwrite_and_is_openpi_readable(tmp_path, tiny):
    config, params = tiny
    path = save_params(tmp_path / "ckpt", params, config)
    with pytest.raises(FileExistsError):
        save_params(path, params, config)
    save_params(path, params, config, overwrite=True)
    openpi_config, openpi_params = load_openpi_params(path, layout="stacked")
    assert openpi_config == config and leaves_equal(openpi_params, params)


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
        config, params = load_openpi_params(path, layout="stacked")
        assert config == tiny[0]
        assert leaves_equal(params, tiny[1])


# One key that inference reads, one it does not: both must be named.
@pytest.mark.parametrize(
    "key", ["PaliGemma/llm/layers/attn/q_einsum_1/w", "PaliGemma/llm/layers/mlp_1/linear"]
)
def test_openpi_missing_key_is_named(tmp_path, tiny_flat, key):
    del tiny_flat[key]
    _write_openpi(tmp_path / "params", tiny_flat)
    with pytest.raises(ValueError, match="missing") as e:
        load_openpi_params(tmp_path / "params")
    assert key in str(e.value)


def test_openpi_misshaped_key_names_key_and_both_shapes(tmp_path, tiny_flat):
    key = "time_mlp_in/bias"
    tiny_flat[key] = jnp.zeros((33,), jnp.float32)
    _write_openpi(tmp_path / "params", tiny_flat)
    with pytest.raises(ValueError) as e:
        load_openpi_params(tmp_path / "params")
    assert f"{key}: expected (32,), got (33,)" in str(e.value)


def test_openpi_extra_keys_are_ignored(tmp_path, tiny, tiny_flat):
    tiny_flat["some_head/kernel"] = jnp.ones((3, 5))
    _write_openpi(tmp_path / "params", tiny_flat, value_suffix=True)
    config, params = load_openpi_params(tmp_path / "params", layout="stacked")
    assert config == tiny[0] and leaves_equal(params, tiny[1])


def test_openpi_lora_factor_without_its_partner_is_named(tmp_path, tiny_flat):
    tiny_flat["PaliGemma/llm/layers/attn/q_einsum/lora_a"] = jnp.ones((2, 4, 64, 4))
    _write_openpi(tmp_path / "params", tiny_flat)
    with pytest.raises(ValueError, match="LoRA") as e:
        load_openpi_params(tmp_path / "params")
    assert "PaliGemma/llm/layers/attn/q_einsum/lora_b: missing" in str(e.value)


def test_openpi_dtype_argument_is_honoured(tmp_path, tiny_flat):
    _write_openpi(tmp_path / "params", tiny_flat)
    config, params = load_openpi_params(tmp_path / "params", dtype="bfloat16", prompt_attention="causal")
    assert (config.dtype, config.prompt_attention) == ("bfloat16", "causal")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}


def test_bad_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_openpi_params(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not an orbax checkpoint"):
        load_openpi_params(tmp_path / "empty")
    step = tmp_path / "step"
    (step / "train_state").mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(ValueError, match="no 'params' item"):
        load_openpi_params(step)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        restore_params(tmp_path / "nope")


def test_openpi_tree_without_params_entry_is_rejected(tmp_path):
    ocp.PyTreeCheckpointer().save((tmp_path / "params").resolve(), {"weights": {"w": np.zeros(3, np.float32)}})
    with pytest.raises(ValueError, match="no 'params' entry"):
        load_openpi_params(tmp_path / "params")


# --------------------------------------------------------------------------------------------
# Norm stats
# --------------------------------------------------------------------------------------------


def test_norm_stats_found_beside_params(tmp_path):
    write_norm_stats(tmp_path, "physical-intelligence/libero", 8)
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "_METADATA").write_text("{}")
    for path in (tmp_path, tmp_path / "params"):
        stats = load_openpi_norm_stats(path)
        assert set(stats) == {"state", "actions"}
        np.testing.assert_array_equal(stats["actions"].q99, np.ones(8))
    write_norm_stats(tmp_path, "droid", 7)
    with pytest.raises(ValueError, match="asset_id"):
        load_openpi_norm_stats(tmp_path)
    assert load_openpi_norm_stats(tmp_path, "droid")["state"].dim == 7
    with pytest.raises(FileNotFoundError, match="aloha"):
        load_openpi_norm_stats(tmp_path, "aloha")


def test_every_openpi_path_is_checked_by_the_manifest_rows():
    rows = check_manifest(_fixture("pi05_param_manifest.json")).rows
    assert [r.path for r in rows] == list(OPENPI_PATHS)


# --------------------------------------------------------------------------------------------
# Damaged checkpoints: never a silent load, never a TensorStore dump
# --------------------------------------------------------------------------------------------


def _largest_data_file(item: Path) -> Path:
    return max((item / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)


def _flip_bytes(path: Path, *, count: int = 64, at: float = 0.5, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    for i in range(start, start + count):
        data[i] ^= mask
    path.write_bytes(bytes(data))


def _assert_one_line(err: pytest.ExceptionInfo, *names: str) -> None:
    msg = str(err.value)
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, ValueError)
    assert "\n" not in msg and "tensorstore_spec" not in msg and len(msg) < 600, msg
    assert any(n in msg for n in names), msg


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory, tiny):
    config, params = tiny
    return save_params(tmp_path_factory.mktemp("own") / "ckpt", params, config)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(p.stat().st_mode | 0o200)  # fixtures are read-only
    return dst


@pytest.mark.parametrize("mask", [0x01, 0xFF], ids=["low-bits", "all-bits"])
def test_own_checkpoint_with_flipped_bytes_in_a_data_file_names_the_leaf(tmp_path, saved_tiny, mask):
    path = _copy(saved_tiny, tmp_path / "ckpt")
    _flip_bytes(_largest_data_file(path / "params"), mask=mask)  # 64 bytes in the middle: raw float data
    with pytest.raises(CheckpointError, match="SHA-256") as e:
        restore_params(path)
    _assert_one_line(e, *OPENPI_PATHS)


def test_own_checkpoint_without_checksums_loads_with_a_warning(tmp_path, saved_tiny, tiny):
    path = _copy(saved_tiny, tmp_path / "ckpt")
    shutil.rmtree(path / "checksums")
    with pytest.warns(UserWarning, match="no checksums"):
        config, params = restore_params(path)
    assert config == tiny[0] and leaves_equal(params, tiny[1])


def test_openpi_checkpoint_with_flipped_bytes_names_the_leaf(tmp_path, tiny_flat):
    # openpi checkpoints carry no checksum: a flipped exponent byte shows as NaN/inf or ~1e36 (or, when
    # orbax happened to put a value's zstd header there, as an unreadable array).
    item = _write_openpi(tmp_path / "params", tiny_flat)
    _flip_bytes(_largest_data_file(item))
    with pytest.raises(CheckpointError, match="damaged") as e:
        load_openpi_params(item)
    _assert_one_line(e, *OPENPI_PATHS)


def test_openpi_fixture_with_flipped_bytes_names_the_leaf(tmp_path):
    item = _copy(_fixture("openpi_tiny_pi05", "params"), tmp_path / "params")
    _flip_bytes(_largest_data_file(item), at=0.3)
    with pytest.raises(CheckpointError, match="damaged") as e:
        load_openpi_params(item)
    _assert_one_line(e, *OPENPI_PATHS)


@pytest.mark.parametrize("value", [np.nan, np.inf, 4.8e36, -2e4])
def test_non_finite_or_implausible_leaf_is_refused_naming_the_leaf(tmp_path, tiny_flat, value):
    key = "PaliGemma/llm/layers/mlp_1/linear"
    tiny_flat[key] = np.asarray(tiny_flat[key]).copy()
    tiny_flat[key][1, 5, 7] = value
    _write_openpi(tmp_path / "params", tiny_flat)
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(CheckpointError, match="non-finite" if not np.isfinite(value) else "above 10000") as e:
            load_openpi_params(tmp_path / "params", dtype=dtype)
        _assert_one_line(e, key)
    if np.isfinite(value):  # a caller who knows better can raise the bound
        load_openpi_params(tmp_path / "params", max_abs=1e37)


def test_value_checks_read_each_leaf_in_chunks_and_still_find_the_last_element(tmp_path, monkeypatch):
    from oxygen_jax.ckpts import orbax_io

    monkeypatch.setattr(orbax_io, "_CHECK_CHUNK", 7)  # chunks that do not divide the leaf
    x = np.zeros((5, 9), np.float32)
    orbax_io.check_values(tmp_path, {"a": x}, max_abs=1.0)
    x[-1, -1] = np.nan
    with pytest.raises(CheckpointError, match="'a' holds 1 non-finite"):
        orbax_io.check_values(tmp_path, {"a": x}, max_abs=1.0)


def test_consuming_conversion_empties_the_host_dict_and_builds_the_same_params(tiny_flat):
    from oxygen_jax.models.pi05.params import from_openpi_dict

    config = model_config("tiny")
    flat = {k: np.asarray(v) for k, v in tiny_flat.items()}
    kept = from_openpi_dict(dict(flat), config)
    consumed = from_openpi_dict(flat, config, consume=True)
    assert flat == {}  # each host array was dropped once converted: restore never holds the weights twice
    assert leaves_equal(kept, consumed)


def _garble(path: Path) -> None:
    path.write_bytes(b"\x00\x9f not what was written {")


_DAMAGE = {
    "_METADATA garbage": (lambda item: _garble(item / "_METADATA"), "_METADATA"),
    "_METADATA truncated": (lambda item: (item / "_METADATA").write_bytes((item / "_METADATA").read_bytes()[:500]), "_METADATA"),
    "_METADATA missing": (lambda item: (item / "_METADATA").unlink(), "_METADATA"),
    "_sharding garbage": (lambda item: _garble(item / "_sharding"), "_sharding"),
    "manifest.ocdbt missing": (lambda item: (item / "manifest.ocdbt").unlink(), "manifest.ocdbt"),
    "manifest.ocdbt garbage": (lambda item: _garble(item / "manifest.ocdbt"), "manifest"),
    "b-tree node garbage": (lambda item: [_garble(p) for p in (item / "d").iterdir()], "/d/"),
    "data file truncated": (lambda item: _largest_data_file(item).write_bytes(_largest_data_file(item).read_bytes()[:999]), "array"),
    "data file garbage": (lambda item: _largest_data_file(item).write_bytes(os.urandom(4096)), "array"),
    "data file missing": (lambda item: _largest_data_file(item).unlink(), "array"),
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_damaged_orbax_directory_gives_one_line_naming_file_and_cause(tmp_path, saved_tiny, damage):
    fn, names = _DAMAGE[damage]
    # A deep directory: TensorStore repeats absolute paths, which must not crowd the file's name out.
    path = _copy(saved_tiny, tmp_path / ("deep-" * 12) / "ckpt")
    fn(path / "params")
    for load in (restore_params, load_openpi_params):
        with pytest.raises(CheckpointError) as e:
            load(path)
        _assert_one_line(e, names)
        assert str(path) in str(e.value)


def test_damaged_json_items_of_own_checkpoint_are_named(tmp_path, saved_tiny):
    path = _copy(saved_tiny, tmp_path / "ckpt")
    _garble(path / "checksums" / "metadata")
    with pytest.raises(CheckpointError) as e:
        restore_params(path)
    _assert_one_line(e, "checksums/metadata")
    _garble(path / "config" / "metadata")
    with pytest.raises(CheckpointError) as e:
        restore_params(path)
    _assert_one_line(e, "config/metadata")
