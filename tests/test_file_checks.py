"""No bad file becomes weights: every file a loader reads is checked before it is used.

The specification (bad files are written into tmp_path from tiny checkpoints the test builds itself, or
from ../shared/fixtures, skipped naming the fixture when it is absent):

* safetensors: a truncated file, a damaged (non-UTF-8) header, overlapping / gapped / mis-sized byte
  spans and a header longer than the file are one-line errors naming the file and the tensor; an index
  entry that is absolute or climbs out with `..` is refused before anything outside is read; a shard that
  is not a regular file or does not hold what the index says is refused;
* native configs (Qwen3, Qwen3-VL, Qwen3.5, XR0, StarVLA): a layer or block count the weights do not
  have is refused in one line naming the config's value and the weights' count, before anything is
  built; sizes above the documented caps (`ckpts.limits`) and malformed fields are refused naming the
  field; a NaN in any weight is refused naming the tensor;
* statistics (StarVLA dataset_statistics.json, openpi norm_stats.json): non-finite or absurd values,
  q01 > q99 and std < 0 are refused naming the file, the field and the dim; q01 == q99 is accepted and
  un-normalises to q01;
* adapters: NaN / inf / huge leaves, alpha NaN / huge / negative, a missing or foreign base fingerprint,
  an unlisted leaf and a load without a base are refused naming the file and the field;
* `serve --action-mask`: a mask above the horizon cap and a link to a device are refused in one line;
  `serve --dataset-key` on a model without dataset statistics is refused naming what takes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from helpers import fixture, write_norm_stats

from oxygen_jax import serve
from oxygen_jax.ckpts import adapters, hf, limits, own, qwen35, starvla, xr0
from oxygen_jax.ckpts.openpi import load_openpi_norm_stats
from oxygen_jax.ckpts.safetensors import read_checkpoint_tensors, read_safetensors, write_safetensors
from oxygen_jax.models import backbone as bb
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.robots.normalize import load_norm_stats

HUGE = 10**6


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text.strip(), text
    return text


def _random(shapes, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return dst


# --------------------------------------------------------------------------------------------------
# Tiny checkpoints written here (every dimension read back from the files by the loaders)


def _vl_spec(depth: int, vision_depth: int) -> bb.BackboneSpec:
    spec = bb.preset("qwen3vl_tiny")
    return dataclasses.replace(spec, depth=depth, vision=dataclasses.replace(
        spec.vision, depth=vision_depth, deepstack_layers=tuple(range(min(2, vision_depth)))))


def _write_hf(d: Path, spec: bb.BackboneSpec) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf.config_from_spec(spec)))
    write_safetensors(d / "model.safetensors", _random(hf.hf_shapes(spec)))
    return d


def _write_xr0(d: Path, vlm_depth: int = 2, dit_depth: int = 1, action_dim: int = 6, horizon: int = 4) -> Path:
    vlm = _vl_spec(vlm_depth, 2)
    config = {"model_type": xr0.MODEL_TYPE, "architectures": [xr0.ARCHITECTURE],
              "vlm_config": hf.config_from_spec(vlm, image_token_id=vlm.vocab_size - 1),
              "dit_config": {"hidden_size": 32, "num_hidden_layers": dit_depth, "head_dim": 16, "num_key_value_heads": 2,
                             "intermediate_size": 64},
              "state_dim": 5, "state_length": 1, "action_dim": action_dim, "action_length": horizon}
    head = xr0.head_spec(config, {}, vlm.depth)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    tensors = {"vlm." + k: v for k, v in _random(hf.hf_shapes(vlm)).items()} | _random(xr0.head_shapes(head), 1)
    write_safetensors(d / "model.safetensors", tensors)
    return d


# --------------------------------------------------------------------------------------------------
# safetensors


def _one_file(tmp_path) -> tuple[Path, dict]:
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((4,), np.float32)}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors)
    return path, tensors


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def test_a_sound_file_reads_back_bit_identical(tmp_path):
    path, tensors = _one_file(tmp_path)
    got = read_safetensors(path)
    assert set(got) == set(tensors) and all(np.array_equal(got[k], v) for k, v in tensors.items())


def test_a_truncated_file_is_named_truncated_with_its_last_tensor(tmp_path):
    path, _ = _one_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-6])
    with pytest.raises(ValueError, match=r"tensor b ends at data byte 40 but the file holds 34 data bytes: .*truncated") as e:
        read_safetensors(path)
    assert str(path) in _one_line(e)


def test_a_damaged_header_is_one_line_not_a_decode_traceback(tmp_path):
    path, _ = _one_file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[10:12] = b"\xff\xfe"
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"the header is not UTF-8 \(byte 2 of \d+\)") as e:
        read_safetensors(path)
    assert type(e.value) is ValueError and str(path) in _one_line(e)
    path.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header length 1000000000 is above the format's limit"):
        read_safetensors(path)
    path.write_bytes((64).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header length 64 runs past the end of the file"):
        read_safetensors(path)


@pytest.mark.parametrize("offsets, match", [
    ([20, 36], r"tensor b at bytes \[20, 36\) overlaps tensor a \(ends at 24\)"),
    ([28, 44], r"bytes \[24, 28\) before tensor b belong to no tensor"),
    ([24, 36], r"tensor b: F32 \[4\] needs 16 bytes but its data_offsets \[24, 36\] span 12"),
    ([40, 24], r"tensor b: data_offsets must be \[begin, end\] with 0 <= begin <= end"),
])
def test_byte_spans_must_tile_the_data_exactly(tmp_path, offsets, match):
    path, _ = _one_file(tmp_path)
    _rewrite_header(path, lambda h: h["b"].update(data_offsets=offsets))
    with pytest.raises(ValueError, match=match) as e:
        read_safetensors(path)
    assert str(path) in _one_line(e)


def test_bytes_after_the_last_tensor_and_a_shape_of_the_wrong_size_are_refused(tmp_path):
    path, _ = _one_file(tmp_path)
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    with pytest.raises(ValueError, match=r"8 bytes after the last tensor \(b\) belong to no tensor"):
        read_safetensors(path)
    path, _ = _one_file(tmp_path)
    _rewrite_header(path, lambda h: h["a"].update(shape=[64, 64]))
    with pytest.raises(ValueError, match=r"tensor a: F32 \[64, 64\] needs 16384 bytes but its data_offsets \[0, 24\] span 24"):
        read_safetensors(path)


def _sharded(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    write_safetensors(d / "model-1.safetensors", {"x": np.zeros(2, np.float32)})
    write_safetensors(d / "model-2.safetensors", {"y": np.ones(3, np.float32)})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-1.safetensors",
                                                                                "y": "model-2.safetensors"}}))
    return d


def test_a_sharded_checkpoint_reads_every_shard(tmp_path):
    got = read_checkpoint_tensors(_sharded(tmp_path))
    assert set(got) == {"x", "y"} and got["y"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("escape", ["absolute", "parent"])
def test_index_entries_outside_the_checkpoint_are_refused_before_reading_them(tmp_path, escape):
    d = _sharded(tmp_path)
    outside = tmp_path / "secret.safetensors"
    write_safetensors(outside, {"z": np.full(2, 7.0, np.float32)})
    entry = str(outside) if escape == "absolute" else "../secret.safetensors"
    _edit_json(d / "model.safetensors.index.json", lambda j: j["weight_map"].update(z=entry))
    with pytest.raises(ValueError, match=rf"tensor z maps to '{entry}', outside the checkpoint directory") as e:
        read_checkpoint_tensors(d)
    _one_line(e)


def test_shards_must_be_regular_files_holding_what_the_index_says(tmp_path):
    d = _sharded(tmp_path)
    _edit_json(d / "model.safetensors.index.json", lambda j: j["weight_map"].update(x="model-2.safetensors"))
    with pytest.raises(ValueError, match=r"index.json: maps tensor x to model-2.safetensors, which does not hold it"):
        read_checkpoint_tensors(d)
    _edit_json(d / "model.safetensors.index.json", lambda j: j["weight_map"].update(x="model-2.safetensors", y="model-1.safetensors"))
    with pytest.raises(ValueError, match=r"model-1.safetensors: holds tensor x, which model.safetensors.index.json "
                                         r"maps to model-2.safetensors"):
        read_checkpoint_tensors(d)
    (tmp_path / "b").mkdir()
    d = _sharded(tmp_path / "b")
    (d / "model-1.safetensors").unlink()
    (d / "model-1.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"model-1.safetensors is not a regular file"):
        read_checkpoint_tensors(d)


# --------------------------------------------------------------------------------------------------
# Native configs: held against the weights' header before anything is built


@pytest.mark.parametrize("depth", [2, 3])
def test_a_qwen3_config_with_a_million_layers_is_refused_naming_both_counts(tmp_path, depth):
    spec = dataclasses.replace(bb.preset("qwen3_tiny"), depth=depth)
    d = _write_hf(tmp_path / "q", spec)
    assert hf.load(d).spec.depth == depth
    _edit_json(d / "config.json", lambda c: c.update(num_hidden_layers=HUGE))
    with pytest.raises(ValueError, match=rf"num_hidden_layers is {HUGE} but the weights hold {depth} "
                                         rf"\(model\.layers\.\{{0\.\.{depth - 1}\}}\.\*\)") as e:
        hf.load(d)
    assert "config.json" in _one_line(e)


@pytest.mark.parametrize("field, value, match", [
    ("vision_config.depth", HUGE, rf"vision_config.depth is {HUGE} but the weights hold 2 \(model\.visual\.blocks\."),
    ("text_config.num_hidden_layers", HUGE, rf"text_config.num_hidden_layers is {HUGE} but the weights hold 3"),
    ("text_config.num_hidden_layers", "many", r"text_config.num_hidden_layers must be an integer"),
    ("text_config.hidden_size", float("nan"), r"text_config.hidden_size must be an integer"),
    ("text_config.vocab_size", 10**12, r"text_config.vocab_size is 1000000000000 but the weights' "
                                       r"model.language_model.embed_tokens.weight has"),
    ("vision_config.deepstack_visual_indexes", [0, 5], r"deepstack_visual_indexes entry 5 is above the cap 1"),
])
def test_a_qwen3_vl_config_the_weights_contradict_is_refused_in_one_line(tmp_path, field, value, match):
    d = _write_hf(tmp_path / "vl", _vl_spec(3, 2))
    part, key = field.split(".")
    _edit_json(d / "config.json", lambda c: c[part].update({key: value}))
    with pytest.raises(ValueError, match=match) as e:
        hf.load(d)
    _one_line(e)


def test_a_qwen35_config_with_a_million_layers_is_refused(tmp_path):
    src = fixture("qwen35_tiny")
    d = _copy(src, tmp_path / "q35")
    depth = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"]
    _edit_json(d / "config.json", lambda c: c["text_config"].update(num_hidden_layers=HUGE, layer_types=None))
    with pytest.raises(ValueError, match=rf"num_hidden_layers is {HUGE} but the weights hold {depth}"):
        qwen35.load(d)


@pytest.mark.parametrize("vlm_depth, dit_depth", [(2, 1), (3, 2)])
def test_xr0_layer_counts_are_checked_against_the_header_first(tmp_path, vlm_depth, dit_depth):
    d = _write_xr0(tmp_path / "x", vlm_depth, dit_depth)
    ck = xr0.load(d)
    assert ck.spec.backbone.depth == vlm_depth and ck.spec.heads[0].depth == dit_depth
    _edit_json(d / "config.json", lambda c: c["vlm_config"]["text_config"].update(num_hidden_layers=HUGE))
    with pytest.raises(ValueError, match=rf"vlm_config.text_config.num_hidden_layers is {HUGE} but the weights hold "
                                         rf"{vlm_depth}") as e:
        xr0.load(d)
    _one_line(e)
    _edit_json(d / "config.json", lambda c: c["vlm_config"]["text_config"].update(num_hidden_layers=vlm_depth))
    _edit_json(d / "config.json", lambda c: c["vlm_config"]["vision_config"].update(depth=HUGE))
    with pytest.raises(ValueError, match=rf"vlm_config.vision_config.depth is {HUGE} but the weights hold 2"):
        xr0.load(d)
    _edit_json(d / "config.json", lambda c: c["vlm_config"]["vision_config"].update(depth=2))
    _edit_json(d / "config.json", lambda c: c["dit_config"].update(num_hidden_layers=dit_depth + 1))
    with pytest.raises(ValueError, match=rf"dit_config.num_hidden_layers is {dit_depth + 1} but the weights hold "
                                         rf"{dit_depth} \(dit\.layers\."):
        xr0.load(d)


@pytest.mark.parametrize("edit, match", [
    (dict(action_length=10**9), rf"action_length 1000000000 is above the cap {limits.MAX_HORIZON}"),
    (dict(action_dim=7), r"action_dim is 7 but the weights' action_projector.layers.0.weight has 6"),
    (dict(state_dim=True), r"state_dim must be an integer"),
])
def test_xr0_sizes_are_capped_and_held_against_the_weights(tmp_path, edit, match):
    d = _write_xr0(tmp_path / "x")
    _edit_json(d / "config.json", lambda c: c.update(edit))
    with pytest.raises(ValueError, match=match) as e:
        xr0.load(d)
    _one_line(e)


@pytest.mark.parametrize("tensor", ["vlm.model.language_model.layers.1.mlp.down_proj.weight",
                                    "dit.layers.0.attn.qkv_proj.weight", "action_output_layer.layers.2.weight"])
def test_a_nan_weight_is_refused_naming_the_tensor(tmp_path, tensor):
    d = _write_xr0(tmp_path / "x")
    tensors = {k: np.array(v) for k, v in read_safetensors(d / "model.safetensors").items()}
    tensors[tensor].reshape(-1)[3] = np.nan
    write_safetensors(d / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=rf"tensor {tensor} holds a non-finite value \(nan at") as e:
        xr0.load(d)
    _one_line(e)


@pytest.mark.parametrize("name", ["starvla_gr00t_tiny", "starvla_qwenpi_v3_tiny"])
def test_starvla_nan_weights_and_absurd_heads_are_refused(tmp_path, name):
    d = _copy(fixture(name), tmp_path / "run")
    tensors = {k: np.array(v) for k, v in read_safetensors(d / "model.safetensors").items()}
    first_block = "action_model.model.transformer_blocks.0.ff.net.2.weight"
    tensors[first_block].reshape(-1)[0] = np.inf
    write_safetensors(d / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=rf"tensor {first_block} holds a non-finite value \(inf"):
        starvla.load(d)
    d = _copy(fixture(name), tmp_path / "run2")
    (d / "config.yaml").write_text((d / "config.yaml").read_text().replace("action_horizon:", "action_horizon: 1000000000 #"))
    with pytest.raises(ValueError, match=r"framework.action_model.action_horizon 1000000000 is above the cap"):
        starvla.load(d)


# --------------------------------------------------------------------------------------------------
# Statistics


def _stats(q01, q99, mask=None) -> dict:
    action = {"q01": q01, "q99": q99} | ({"mask": mask} if mask is not None else {})
    return {"robot": {"action": action}}


@pytest.mark.parametrize("q01, q99, match", [
    ([float("nan"), 0.0], [1.0, 1.0], r"q01\[0\] = nan: statistics must be finite"),
    ([0.0, 0.0], [1.0, 1e300], r"q99\[1\] = 1e\+300: statistics must be finite and within ±1e\+06"),
    ([0.0, 2.0], [1.0, 1.0], r"q01\[1\] = 2.0 is above q99\[1\] = 1.0"),
    ([0.0, 0.0, 0.0], [1.0, 1.0], r"q01, q99 and mask must be lists of one length"),
])
def test_starvla_action_statistics_must_be_finite_bounded_and_ordered(q01, q99, match):
    with pytest.raises(ValueError, match=match) as e:
        starvla.action_stats(_stats(q01, q99))
    assert "robot.action" in _one_line(e)


def test_a_constant_dim_with_q01_equal_to_q99_unnormalises_to_q01():
    stats = starvla.action_stats(_stats([-2.0, 0.5], [2.0, 0.5]))
    out = starvla.unnormalize_actions(np.array([[0.5, -0.3], [-1.0, 0.9]]), stats, gripper_dim=None)
    np.testing.assert_allclose(out, [[1.0, 0.5], [-2.0, 0.5]])


def test_a_starvla_run_with_nan_statistics_is_refused_at_load(tmp_path):
    d = _copy(fixture("starvla_qwenpi_v3_tiny"), tmp_path / "run")
    (d / "dataset_statistics.json").write_text(json.dumps(_stats([float("nan")] * 7, [1.0] * 7)))
    with pytest.raises(ValueError, match=r"dataset_statistics.json: robot.action: q01\[0\] = nan"):
        starvla.load(d)


@pytest.mark.parametrize("field, value, match", [
    ("mean", float("nan"), r"mean\[1\] = nan"), ("std", -1.0, r"std\[1\] = -1.0 is negative"),
    ("q99", -5.0, r"q01\[1\] = -1.0 is above q99\[1\] = -5.0"), ("q01", -1e300, r"q01\[1\] = -1e\+300"),
])
def test_openpi_norm_stats_must_be_finite_with_std_nonnegative_and_ordered_quantiles(tmp_path, field, value, match):
    write_norm_stats(tmp_path, "robot", 3)
    path = tmp_path / "assets" / "robot" / "norm_stats.json"
    assert load_norm_stats(path)["state"].dim == 3
    _edit_json(path, lambda j: j["norm_stats"]["actions"][field].__setitem__(1, value))
    with pytest.raises(ValueError, match=match) as e:
        load_openpi_norm_stats(tmp_path)
    assert "norm_stats['actions']" in _one_line(e)


# --------------------------------------------------------------------------------------------------
# Adapters


@pytest.fixture(scope="module")
def base_and_adapter(tiny_params, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = own.save_params(root / "base", tiny_params)
    other = own.save_params(root / "other", tiny_params.replace(embedding=tiny_params.embedding + 1.0))
    adapter = pi05_lora.init_bank(tiny_params.config, 1, rank=2, seed=3).adapter(1)
    path = adapters.save_adapter(root / "adapter", adapter, prompt="Memory: ", base=base)
    return tiny_params.config, base, other, path


def _adapter_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _set_leaf(path: Path, leaf: str, value: float) -> None:
    """Writes `value` into one LoRA leaf and records its new SHA-256, as a forger would."""
    flat = flatten_dict(ocp.PyTreeCheckpointer().restore(path / "lora"), sep="/")
    arr = np.array(flat[leaf])
    arr.reshape(-1)[0] = value
    flat[leaf] = arr
    shutil.rmtree(path / "lora")
    ocp.PyTreeCheckpointer().save(path / "lora", unflatten_dict(flat, sep="/"))
    _edit_json(path / "adapter.json", lambda m: m["leaves"][leaf].update(sha256=adapters._sha256(arr)))


def test_a_sound_adapter_loads_on_its_base(base_and_adapter):
    config, base, _, path = base_and_adapter
    _, meta = adapters.load_adapter(path, config, base=base)
    assert meta["base_fingerprint"] == adapters.base_fingerprint(base)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e38])
def test_adapter_leaves_must_be_finite_and_bounded(base_and_adapter, tmp_path, value):
    config, base, _, src = base_and_adapter
    path = _adapter_copy(src, tmp_path / "a")
    leaf = "PaliGemma/llm/layers/mlp/linear_lora_b"
    _set_leaf(path, leaf, value)
    with pytest.raises(ValueError, match=rf"tensor {leaf} holds a (non-finite value|value beyond ±10000)") as e:
        adapters.load_adapter(path, config, base=base)
    assert "lora" in _one_line(e)


@pytest.mark.parametrize("alpha", [float("nan"), 1e300, -4, 0, "2", True])
def test_adapter_alpha_must_be_a_finite_positive_number_within_the_cap(base_and_adapter, tmp_path, alpha):
    config, base, _, src = base_and_adapter
    path = _adapter_copy(src, tmp_path / "a")
    _edit_json(path / "adapter.json", lambda m: m.update(alpha=alpha))
    with pytest.raises(ValueError, match=r"adapter.json: alpha must be a finite number in \(0, 4096\]") as e:
        adapters.load_adapter(path, config, base=base)
    _one_line(e)


def test_the_base_fingerprint_is_required_and_checked(base_and_adapter, tmp_path):
    config, base, other, src = base_and_adapter
    path = _adapter_copy(src, tmp_path / "a")
    with pytest.raises(ValueError, match="was trained on base .* holds other weights"):
        adapters.load_adapter(path, config, base=other)
    with pytest.raises(ValueError, match="pass the base checkpoint the adapter will run on"):
        adapters.load_adapter(path, config)
    _edit_json(path / "adapter.json", lambda m: m.pop("base_fingerprint"))
    with pytest.raises(ValueError, match="adapter.json: base_fingerprint is missing") as e:
        adapters.load_adapter(path, config, base=other)
    _one_line(e)
    with pytest.raises(ValueError, match="is not a π checkpoint"):
        adapters.save_adapter(tmp_path / "b", adapters.load_adapter(src, config, base=base)[0], prompt="x", base=tmp_path)


def test_every_leaf_in_lora_must_be_listed_with_its_digest(base_and_adapter, tmp_path):
    config, base, _, src = base_and_adapter
    path = _adapter_copy(src, tmp_path / "a")
    leaf = "PaliGemma/llm/layers/attn/q_einsum/lora_a"
    _edit_json(path / "adapter.json", lambda m: m["leaves"].pop(leaf))
    with pytest.raises(ValueError, match=f"leaf '{leaf}' in lora/ is not listed"):
        adapters.load_adapter(path, config, base=base)


# --------------------------------------------------------------------------------------------------
# serve --action-mask, --dataset-key


def _serve_args(*extra):
    return serve._parser().parse_args(["--port", "0", *extra])


def test_an_action_mask_above_the_horizon_cap_is_refused(tmp_path):
    path = tmp_path / "mask.npy"
    np.save(path, np.ones((200_000, 8), np.float32))
    with pytest.raises(ValueError, match=rf"--action-mask .*mask.npy: shape \(200000, 8\) is above the caps of "
                                         rf"{limits.MAX_HORIZON} steps") as e:
        serve._action_mask(_serve_args("--action-mask", str(path)))
    _one_line(e)
    with pytest.raises(ValueError, match=r"action_mask of shape \(2000, 6\) is above the caps"):
        xr0.load(_write_xr0(tmp_path / "x"), action_mask=np.ones((2000, 6)))


def test_an_action_mask_linked_to_a_device_is_refused_unread(tmp_path):
    link = tmp_path / "mask.json"
    os.symlink("/dev/urandom", link)
    with pytest.raises(ValueError, match=r"--action-mask .*mask.json: cannot read .*not a regular file"):
        serve._action_mask(_serve_args("--action-mask", str(link)))


def test_a_dataset_key_for_a_model_without_dataset_statistics_is_refused(tmp_path, capsys):
    d = _write_xr0(tmp_path / "x")
    assert serve.main(["--ckpt", str(d), "--dataset-key", "libero", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "argument --dataset-key: only a StarVLA checkpoint with a dataset_statistics.json takes it" in err
    assert "Xiaomi-Robotics-0" in err and len(err.strip().splitlines()) == 1
    assert serve.main(["--preset", "tiny", "--dataset-key", "libero", "--port", "0"]) == 2
    assert "a preset has no dataset statistics" in capsys.readouterr().err
