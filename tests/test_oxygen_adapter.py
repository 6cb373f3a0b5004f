"""OxyGen's released adapter in and out: an OxyGen-layout file (openpi's LoRA keys on the VLM expert, a leading
layer axis, dims read from the base) imports into our adapter format, its merged weights compute openpi's
einsum-form LoRA, `serve --adapter NAME=DIR` serves it by name, it exports back byte for byte, bad files are
refused naming the key or field, and `training.memory --base` takes an openpi checkpoint."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from helpers import make_obs, openpi_fixture, shared_dir
from oxygen_jax import serve
from oxygen_jax.ckpts import own
from oxygen_jax.ckpts.adapters import base_fingerprint, load_adapter, save_adapter
from oxygen_jax.ckpts.oxygen_adapter import CONFIG_FILE, base_config, export_oxygen, import_oxygen, load_named_bank, main
from oxygen_jax.ckpts.safetensors import write_safetensors
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import init_params, to_openpi_dict

W = "PaliGemma/llm/layers"
# openpi path of each adapted weight -> its LoRA keys (attention: .../lora_a; feed-forward: ..._lora_a).
WEIGHTS = {f"{W}/attn/q_einsum/w": f"{W}/attn/q_einsum/lora_", f"{W}/attn/kv_einsum/w": f"{W}/attn/kv_einsum/lora_",
           f"{W}/attn/attn_vec_einsum/w": f"{W}/attn/attn_vec_einsum/lora_", f"{W}/mlp/gating_einsum": f"{W}/mlp/gating_einsum_lora_",
           f"{W}/mlp/linear": f"{W}/mlp/linear_lora_"}


def _wider(config):
    """The tiny preset with another VLM width, MLP and KV heads (the action expert keeps sharing heads)."""
    return config.replace(vlm=dataclasses.replace(config.vlm, width=48, mlp_dim=80, num_kv_heads=1),
                          action_expert=dataclasses.replace(config.action_expert, num_kv_heads=1))


@pytest.fixture(scope="module", params=[("tiny", 3, 6.0), ("wider", 5, 5.0)], ids=["tiny-r3", "wider-r5"])
def case(request, tmp_path_factory):
    """(base params, our base directory, rank, alpha) at two widths and ranks."""
    kind, rank, alpha = request.param
    cfg = model_config("tiny")
    params = init_params(cfg if kind == "tiny" else _wider(cfg), 0)
    base = own.save_params(tmp_path_factory.mktemp("base") / "base", params)
    return params, base, rank, alpha


def _oxygen_arrays(params, rank: int, seed: int = 0) -> dict[str, np.ndarray]:
    """OxyGen's keys and shapes from the base's own weights by openpi's rule (A: rank on the last axis, B: rank on
    the second to last), float32, in a non-sorted order (the file's order must survive a round trip)."""
    rng = np.random.default_rng(seed)
    flat = to_openpi_dict(params)
    out = {}
    for weight, key in reversed(WEIGHTS.items()):
        shape = flat[weight].shape
        out[key + "a"] = (0.3 * rng.standard_normal((*shape[:-1], rank))).astype(np.float32)
        out[key + "b"] = (0.3 * rng.standard_normal((*shape[:-2], rank, shape[-1]))).astype(np.float32)
    return out


def _write_oxygen(folder, arrays, rank, alpha, fmt="npz", changes=None):
    """An OxyGen release folder: adapter_step_1500.<fmt> and an adapter_config.json with its fields."""
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"adapter_step_1500.{fmt}"
    if fmt == "npz":
        np.savez(file, **arrays)
    else:
        write_safetensors(file, arrays)
    cfg = {"adapter_type": "suffix_lora", "alpha": alpha, "rank": rank, "base_checkpoint": "gs://x/pi05_libero",
           "language_target": "visual_memory", "suffix_length": 28, "suffix_seed": "Memory: ", "training_step": 1500,
           **(changes or {})}
    (folder / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
    return folder


_EQ = {  # (base einsum, x·A, (x·A)·B) per weight, every layer l at once; openpi's LoRA equations
    f"{W}/attn/q_einsum/w": ("td,lndh->ltnh", "td,lndr->ltnr", "ltnr,lnrh->ltnh"),
    f"{W}/attn/kv_einsum/w": ("td,lckdh->lctkh", "td,lckdr->lctkr", "lctkr,lckrh->lctkh"),
    f"{W}/attn/attn_vec_einsum/w": ("tnh,lnhd->ltd", "tnh,lnhr->ltr", "ltr,lnrd->ltd"),  # heads summed in both
    f"{W}/mlp/gating_einsum": ("td,lcdf->lctf", "td,lcdr->lctr", "lctr,lcrf->lctf"),
    f"{W}/mlp/linear": ("tf,lfd->ltd", "tf,lfr->ltr", "ltr,lrd->ltd"),
}
_SCALED = (f"{W}/attn/q_einsum/w", f"{W}/attn/kv_einsum/w", f"{W}/attn/attn_vec_einsum/w")


def _inputs(flat, rng):
    """Activations each weight reads: x [T, D] (q, kv, gating), attention output [T, N, H], MLP hidden [T, F]."""
    n, d, h = flat[f"{W}/attn/q_einsum/w"].shape[1:]
    f = flat[f"{W}/mlp/linear"].shape[1]
    x, o, m = rng.standard_normal((3, d)), rng.standard_normal((3, n, h)), rng.standard_normal((3, f))
    return {w: (o if "attn_vec" in w else m if w.endswith("linear") else x) for w in _EQ}


def _openpi_lora(flat, arrays, scale, inputs):
    """openpi's LoRA layers evaluated directly in float64: W plus s·(x·A)·B on attention (s = alpha / rank),
    plus the unscaled (x·A)·B on the feed-forward."""
    out = {}
    for w, (base_eq, a_eq, b_eq) in _EQ.items():
        a, b = (np.asarray(arrays[WEIGHTS[w] + c], np.float64) for c in "ab")
        lora_term = np.einsum(b_eq, np.einsum(a_eq, inputs[w], a), b)
        out[w] = np.einsum(base_eq, inputs[w], np.asarray(flat[w], np.float64)) + (scale if w in _SCALED else 1.0) * lora_term
    return out


def _plain(flat, inputs):
    """The same layers through plain weights, float64."""
    return {w: np.einsum(eq[0], inputs[w], np.asarray(flat[w], np.float64)) for w, eq in _EQ.items()}


def test_an_imported_adapter_merges_into_openpis_einsum_form_of_the_lora(case, tmp_path):
    params, base, rank, alpha = case
    arrays = _oxygen_arrays(params, rank)
    dest = import_oxygen(_write_oxygen(tmp_path / "ox", arrays, rank, alpha), tmp_path / "ours", base=base)
    adapter, meta = load_adapter(dest, params.config, base=base)
    assert (meta["rank"], meta["alpha"], meta["prompt"], meta["name"]) == (rank, alpha, "Memory: ", "memory")
    assert meta["base_fingerprint"] == base_fingerprint(base)
    merged = to_openpi_dict(pi05_lora.merge(params, pi05_lora.ModelLora(vlm=adapter, action_expert=None)))
    flat = to_openpi_dict(params)
    inputs = _inputs(flat, np.random.default_rng(1))
    want, got, before = _openpi_lora(flat, arrays, alpha / rank, inputs), _plain(merged, inputs), _plain(flat, inputs)
    for w in _EQ:
        assert np.abs(want[w] - before[w]).max() > 0.1, w  # the adapter changes every layer's output
        np.testing.assert_allclose(got[w], want[w], rtol=1e-5, atol=1e-5 * np.abs(want[w]).max(), err_msg=w)


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_import_then_export_gives_back_the_same_bytes(case, tmp_path, fmt):
    params, base, rank, alpha = case
    src = _write_oxygen(tmp_path / "ox", _oxygen_arrays(params, rank), rank, alpha, fmt=fmt)
    dest = import_oxygen(src, tmp_path / "ours", base=base)
    file = export_oxygen(dest, tmp_path / "back", base=base)
    assert file.name == f"adapter_step_1500.{fmt}"
    assert file.read_bytes() == (src / file.name).read_bytes()
    assert (file.parent / CONFIG_FILE).read_bytes() == (src / CONFIG_FILE).read_bytes()
    other = {"npz": "safetensors", "safetensors": "npz"}[fmt]  # the other format: same keys, a new sha256
    converted = export_oxygen(dest, tmp_path / "other", base=base, fmt=other)
    assert json.loads((converted.parent / CONFIG_FILE).read_text())["suffix_seed"] == "Memory: "
    a, _ = load_adapter(import_oxygen(converted, tmp_path / "again", base=base), params.config, base=base)
    b, _ = load_adapter(dest, params.config, base=base)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_an_adapter_trained_here_exports_to_oxygens_keys_and_imports_back_bit_identical(case, tmp_path):
    params, base, rank, alpha = case
    bank = pi05_lora.init_bank(params.config, 1, rank=rank, alpha=alpha, seed=4)
    ours = save_adapter(tmp_path / "ours", bank.adapter(1), prompt="Subtask: ", name="next", base=base,
                        extra={"label_key": "next", "suffix_len": 20, "steps": 7})
    file = export_oxygen(ours, tmp_path / "ox", base=base, fmt="safetensors")
    config = json.loads((file.parent / CONFIG_FILE).read_text())
    assert (config["rank"], config["alpha"], config["suffix_seed"], config["suffix_length"]) == (rank, alpha, "Subtask: ", 19)
    back = import_oxygen(file.parent, tmp_path / "again", base=base, name="next")
    a, meta = load_adapter(back, params.config, base=base)
    b, _ = load_adapter(ours, params.config, base=base)
    assert meta["prompt"] == "Subtask: " and meta["extra"]["label_key"] == "next"
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))) and a.alpha == b.alpha


def test_serve_adapter_name_equals_dir_serves_ours_and_an_oxygen_folder_by_name(case, tmp_path):
    params, base, rank, alpha = case
    arrays = _oxygen_arrays(params, rank)
    src = _write_oxygen(tmp_path / "ox", arrays, rank, alpha)
    dest = import_oxygen(src, tmp_path / "ours", base=base)
    args = serve._parser().parse_args(["--ckpt", str(base), "--adapter", f"memory={dest}", "--adapter", f"raw={src}",
                                       "--batch-sizes", "1", "--tokenizer", "demo"])  # random weights: no tokenizer
    engine = serve.build(args)[0]
    assert engine.limits.adapters == ("base", "memory", "raw")  # names by id
    prefix = dict(zip(("q", "kv", "out", "gating", "linear"), WEIGHTS.values()))  # our target -> OxyGen's keys
    for target, pair in engine.bank.adapters.pairs().items():
        for c in "ab":
            for adapter_id in (1, 2):  # [L, E, ...]: both the imported directory and the folder read on load
                np.testing.assert_array_equal(np.asarray(getattr(pair, c))[:, adapter_id - 1], arrays[prefix[target] + c])
    with pytest.raises(ValueError, match="share a name"):
        load_named_bank([str(dest), str(src)], params.config, base=base)  # both are "memory"
    # Served: a request on each name decodes in one engine step; both names hold the same arrays, the base does not.
    ids = {name: engine.submit(prompt_tokens=[5, 6, 7], max_tokens=6, stop_ids=(), adapter=name)
           for name in ("base", "memory", "raw")}
    obs = make_obs(params.config, batch=1)
    done = {}
    for _ in range(6):
        done.update({f.request_id: list(f.tokens) for f in engine.step(obs).finished})
        if len(done) == len(ids):
            break
    text = {name: done[i] for name, i in ids.items()}
    assert len(text["raw"]) == 6 and text["raw"] == text["memory"] and text["raw"] != text["base"], text


def _damage(arrays, rank, alpha, how):
    """(arrays, adapter_config fields) spoiled one way; the message names the key or field."""
    q_a, lin_b, gate_b = f"{W}/attn/q_einsum/lora_a", f"{W}/mlp/linear_lora_b", f"{W}/mlp/gating_einsum_lora_b"
    arrays, config = dict(arrays), {}
    if how == "unknown key":
        arrays[f"{W}/attn/q_einsum_1/lora_a"] = arrays[q_a]
        return arrays, config, r"unknown key '.*q_einsum_1/lora_a' \(an action-expert key"
    if how == "bottleneck key":
        arrays[f"{W}/suffix_lora/down/kernel"] = arrays[q_a][..., 0]
        return arrays, config, r"unknown key '.*suffix_lora/down/kernel'"
    if how == "missing key":
        del arrays[lin_b]
        return arrays, config, f"key '{lin_b}' is missing"
    if how == "wrong shape":
        arrays[gate_b] = np.concatenate([arrays[gate_b], arrays[gate_b][..., :1]], axis=-1)
        return arrays, config, rf"key '{gate_b}' has shape .*expected"
    if how == "nan":
        arrays[q_a] = arrays[q_a].copy()
        arrays[q_a][0, 0, 0, 0] = np.nan
        return arrays, config, rf"tensor {q_a} holds a non-finite value"
    if how == "rank mismatch":
        return arrays, {"rank": rank + 1}, rf"key '{q_a}' has shape .*its rank {rank} differs from rank {rank + 1}"
    if how == "alpha missing":
        return arrays, {"alpha": None}, r"adapter_config.json: alpha must be a number in \(0, 4096\]"
    if how == "adapter type":
        return arrays, {"adapter_type": "bottleneck"}, "adapter_type 'bottleneck' is not 'suffix_lora'"
    if how == "sha256":
        return arrays, {"sha256": "0" * 64}, "SHA-256 differs from the sha256 in"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["unknown key", "bottleneck key", "missing key", "wrong shape", "nan", "rank mismatch",
                                 "alpha missing", "adapter type", "sha256"])
def test_a_bad_oxygen_adapter_is_refused_in_one_line_naming_the_key_or_field(case, tmp_path, how, capsys):
    params, base, rank, alpha = case
    arrays, config, message = _damage(_oxygen_arrays(params, rank), rank, alpha, how)
    src = _write_oxygen(tmp_path / "ox", arrays, rank, alpha, changes=config)
    with pytest.raises(ValueError, match=message) as e:
        import_oxygen(src, tmp_path / "ours", base=base)
    assert "\n" not in str(e.value) and not (tmp_path / "ours").exists()
    assert main(["import", str(src), str(tmp_path / "ours"), "--base", str(base)]) == 2  # the CLI: one line, status 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m oxygen_jax.ckpts.oxygen_adapter import: error:")


def test_the_cli_imports_and_exports_and_its_help_names_both(case, tmp_path, capsys):
    params, base, rank, alpha = case
    src = _write_oxygen(tmp_path / "ox", _oxygen_arrays(params, rank), rank, alpha)
    assert main(["import", str(src), str(tmp_path / "ours"), "--base", str(base), "--name", "mem"]) == 0
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "back"), "--base", str(base)]) == 0
    assert (tmp_path / "back" / "adapter_step_1500.npz").read_bytes() == (src / "adapter_step_1500.npz").read_bytes()
    assert json.loads((tmp_path / "ours" / "adapter.json").read_text())["name"] == "mem"
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "{import,export}" in out


def test_training_memory_takes_an_openpi_checkpoint_as_base_and_its_adapter_goes_out_and_back(tmp_path, capsys):
    from training.memory.__main__ import main as train_main
    from training.data.frames import write_memory_dataset
    from training.data.synthetic_memory import SyntheticMemoryConfig, synthetic_splits

    fixture = openpi_fixture()
    config = base_config(fixture)  # from the checkpoint's metadata
    frames = synthetic_splits(SyntheticMemoryConfig(image_size=config.siglip.image_size, num_inits=2, num_train_inits=1))
    data = write_memory_dataset(tmp_path / "syn", frames, image_size=config.siglip.image_size, name="syn")
    out = tmp_path / "run"
    # openpi's checkpoints ship no tokenizer (refused without one): the LeRobot fixture's fits the 1024-row vocabulary
    tokenizer = shared_dir() / "fixtures" / "lerobot_tiny_pi05" / "tokenizer" / "tokenizer.model"
    if not tokenizer.is_file():
        pytest.skip(f"../shared fixtures not present: {tokenizer} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    assert train_main(["--data", str(data), "--out", str(out), "--base", str(fixture), "--steps", "1", "--batch-size", "1",
                       "--rank", "2", "--prompt-len", "32", "--eval-split", "", "--devices", "1", "--no-progress",
                       "--tokenizer", str(tokenizer)]) == 0
    assert "adapter: openpi checkpoint" in capsys.readouterr().out
    adapter, meta = load_adapter(out / "adapter", config, base=fixture)
    assert meta["base_fingerprint"] == base_fingerprint(fixture) == base_fingerprint(fixture / "params")
    assert adapter.attn_rank == 2 and np.abs(np.asarray(adapter.q.b)).max() > 0  # one step moved B off zero
    file = export_oxygen(out / "adapter", tmp_path / "ox", base=fixture)
    back, _ = load_adapter(import_oxygen(file.parent, tmp_path / "again", base=fixture), config, base=fixture)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(adapter)))


def test_openpis_own_vlm_lora_imported_as_an_oxygen_file_merges_to_openpis_merged_weights(tmp_path):
    """The openpi LoRA fixture's VLM factors (written by openpi) as an OxyGen file on that checkpoint: the merged
    VLM weights equal the fixture's merged_params.npz (openpi's equations in float64, rounded to float32)."""
    from oxygen_jax.ckpts.openpi import load_openpi_lora, load_openpi_params
    from oxygen_jax.ckpts.openpi_lora import to_openpi

    fixture = openpi_fixture().parent / "openpi_tiny_pi05_lora"
    if not fixture.exists():
        pytest.skip(f"../shared fixtures not present: {fixture} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    vlm = load_openpi_lora(fixture).vlm
    arrays = {k: np.asarray(v) for k, v in to_openpi(pi05_lora.ModelLora(vlm=vlm, action_expert=None)).items()}
    rank = int(arrays[f"{W}/attn/q_einsum/lora_a"].shape[-1])
    dest = import_oxygen(_write_oxygen(tmp_path / "ox", arrays, rank, rank), tmp_path / "ours", base=fixture)
    _, params = load_openpi_params(fixture, lora="ignore")
    adapter, _ = load_adapter(dest, params.config, base=fixture)
    merged = to_openpi_dict(pi05_lora.merge(params, pi05_lora.ModelLora(vlm=adapter, action_expert=None)))
    want, before = np.load(fixture / "merged_params.npz"), to_openpi_dict(params)
    for w in WEIGHTS:
        np.testing.assert_allclose(np.asarray(merged[w]), want[w], rtol=1e-6, atol=1e-6, err_msg=w)
        assert not np.allclose(np.asarray(before[w]), want[w], atol=1e-4), w  # the LoRA matters


def test_the_full_size_train_step_traces_with_a_bf16_base_and_a_float32_adapter_of_oxygens_size():
    """eval_shape (no memory): π0.5 at full size, bf16 base, rank 16 on every VLM target at OxyGen's shapes
    (B 2, Tp 100, T 29) is what eval/device_check.sh times; its trainable leaves are float32 and as many as
    OxyGen's released file holds (its trainer checks 18 layers x rank x 96,768)."""
    from training.memory.data import random_batch
    from oxygen_jax.ckpts.oxygen_adapter import expected_shapes
    from oxygen_jax.models.pi05.params import abstract_params
    from training.memory.config import TrainConfig
    from training.memory.model import init_state, make_train_step

    cfg = model_config("pi05", dtype="bfloat16")
    config = TrainConfig(batch_size=2, suffix_len=29, rank=16)
    step = make_train_step(config)
    params = abstract_params(cfg)
    state = jax.eval_shape(lambda p: init_state(config, p, step.optimizer), params)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), random_batch(cfg, 2, 3, 100, 29))
    new_state, metrics = jax.eval_shape(step.fn, state, params, batch)
    leaves = jax.tree.leaves(new_state.trainable)
    assert {x.dtype for x in leaves} == {np.dtype(np.float32)} and metrics["loss"].shape == ()
    assert sum(x.size for x in leaves) == sum(np.prod(s) for s in expected_shapes(cfg, 16).values()) == 18 * 16 * 96_768


def test_an_export_never_writes_a_stale_config_the_rank_and_alpha_are_the_adapters(case, tmp_path):
    params, base, rank, alpha = case
    dest = import_oxygen(_write_oxygen(tmp_path / "ox", _oxygen_arrays(params, rank), rank, alpha), tmp_path / "ours",
                         base=base)
    meta = json.loads((dest / "adapter.json").read_text())
    (dest / "adapter.json").write_text(json.dumps({**meta, "alpha": 2 * alpha}))  # re-scaled after the import
    file = export_oxygen(dest, tmp_path / "back", base=base)
    config = json.loads((file.parent / CONFIG_FILE).read_text())
    assert (config["rank"], config["alpha"], config["suffix_seed"]) == (rank, 2 * alpha, "Memory: ")
