"""LeRobot π0.5 / π0 checkpoints (`ckpts.lerobot`) and LeRobot's preprocessing (`robots.lerobot`).

Against the two shared fixtures (LeRobot 0.6.1's own `save_pretrained` folders and its outputs): restore, sizes
and I/O facts from the files, the preprocessing (numpy only), K/V and 3-step actions. Against a folder written
here with other sizes (2 KV heads, 3 SigLIP heads, other widths, image size, action / state dims, MEAN_STD, an
empty camera), so nothing is tuned to the fixtures: sizes from the tensors and the layout of every projection.
"""

from __future__ import annotations

import json
import math
import shutil

import jax
import numpy as np
import pytest

from oxygen_jax.ckpts import lerobot as L
from oxygen_jax.ckpts.safetensors import read_safetensors, write_safetensors
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.pi05 import model
from oxygen_jax.robots import lerobot as lr
from oxygen_jax.robots.tokenizer import Tokenizer, discretize_state
from tests.helpers import fixture, leaves_equal

FIXTURES = ("lerobot_tiny_pi05", "lerobot_tiny_pi0")
_PG = "paligemma_with_expert.paligemma.model"
_LLM, _EXP, _VIS = f"{_PG}.language_model", "paligemma_with_expert.gemma_expert.model", f"{_PG}.vision_tower.vision_model"


def _spec(root):
    return json.loads((root / "generation_config.json").read_text())["spec"]


def _load(root, dtype="float32"):
    return L.load(root, dtype, vision_heads=_spec(root)["vision"]["num_attention_heads"])


# -------------------------------------------------------------------------------------------------
# The fixtures: restore, sizes, I/O facts
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_restores_with_sizes_and_io_from_its_files(name):
    root = fixture(name)
    spec, cfg = _spec(root), json.loads((root / "pretrained_model" / "config.json").read_text())
    assert L.is_lerobot_dir(root) and L.is_lerobot_dir(root / "pretrained_model")
    ck = _load(root)
    c, io = ck.config, ck.io
    assert c.variant == cfg["type"] == io.variant
    for ours, theirs in ((c.vlm, spec["llm"]), (c.action_expert, spec["expert"])):
        assert (ours.width, ours.depth, ours.mlp_dim, ours.num_heads, ours.num_kv_heads, ours.head_dim) == tuple(
            theirs[k] for k in ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"))
    v = spec["vision"]
    assert (c.siglip.width, c.siglip.depth, c.siglip.mlp_dim, c.siglip.patch_size, c.siglip.image_size) == (
        v["hidden_size"], v["num_hidden_layers"], v["intermediate_size"], v["patch_size"], spec["image_resolution"])
    assert (c.vocab_size, c.action_dim) == (spec["vocab"], spec["max_action_dim"])
    assert io.cameras == tuple(spec["cameras"]) and io.image_resolution == (spec["image_resolution"],) * 2
    assert (io.state_dim, io.action_dim, io.chunk_size, io.tokenizer_max_length) == (
        spec["state_dim"], spec["action_dim"], spec["chunk_size"], spec["tokenizer_max_length"])
    assert io.tokenizer_name == "google/paligemma-3b-pt-224"
    modes = {k: io.normalize[k].mode for k in (lr.STATE_KEY, lr.ACTION_KEY)}
    assert modes == {lr.STATE_KEY: cfg["normalization_mapping"]["STATE"], lr.ACTION_KEY: cfg["normalization_mapping"]["ACTION"]}
    assert io.unnormalize[lr.ACTION_KEY].mode == cfg["normalization_mapping"]["ACTION"]
    # Key map complete: every tensor became a leaf, except the two lm_heads the action path never reads.
    assert ck.unused == () and ck.tensor_names == "lerobot" and ck.embedding.endswith("embed_tokens.weight")


def test_openpi_pytorch_names_read_the_same(tmp_path):
    """openpi's conversion: no `model.` prefix, transformers' older PaliGemma names, the embedding only as the
    tied lm_head (LeRobot copies it into embed_tokens): the same parameters."""
    root = fixture("lerobot_tiny_pi05")
    tensors = dict(read_safetensors(root / "pretrained_model" / L.WEIGHTS))
    tensors["model.paligemma_with_expert.paligemma.lm_head.weight"] = tensors.pop(f"model.{_LLM}.embed_tokens.weight")
    legacy = {f"{_PG}.language_model.": "paligemma_with_expert.paligemma.language_model.model.",
              f"{_PG}.vision_tower.": "paligemma_with_expert.paligemma.vision_tower."}
    renamed = {}
    for k, value in tensors.items():
        k = k.removeprefix("model.")
        for new, old in legacy.items():
            k = old + k[len(new):] if k.startswith(new) else k
        renamed[k] = np.asarray(value)
    d = tmp_path / "pretrained_model"
    shutil.copytree(root / "pretrained_model", d)
    write_safetensors(d / L.WEIGHTS, renamed)
    ours, theirs = L.load(d, vision_heads=2), _load(root)
    assert ours.tensor_names == "openpi" and ours.embedding.endswith("lm_head.weight")
    assert leaves_equal(ours.params, theirs.params)


def test_missing_tensor_refused_in_one_line(tmp_path):
    root = fixture("lerobot_tiny_pi0")
    d = tmp_path / "pretrained_model"
    shutil.copytree(root / "pretrained_model", d)
    tensors = {k: np.array(v) for k, v in read_safetensors(d / L.WEIGHTS).items()}  # copies: the file is rewritten
    gone = f"model.{_EXP}.layers.2.mlp.up_proj.weight"
    del tensors[gone]
    write_safetensors(d / L.WEIGHTS, tensors)
    with pytest.raises(ValueError, match="missing tensor " + gone.removeprefix("model.").replace(".", r"\.")) as e:
        L.load(tmp_path, vision_heads=2)
    assert "\n" not in str(e.value) and "random" in str(e.value)


@pytest.mark.parametrize("damage, message", [
    ("no_preprocessor", "LeRobot π0 checkpoint .* missing policy_preprocessor.json"),
    ("nan_stat", r"normalizer_processor.safetensors: tensor observation.state.mean holds a non-finite value"),
    ("unknown_step", "processor step 'my_filter' is not one this loader reproduces"),
    ("relative_actions", "relative_actions_processor is enabled"),
    ("truncated", "truncated"),
    ("other_siglip", "^[^:]*model.safetensors: SigLIP width 32 is not LeRobot's So400m .* pass vision_heads=$"),
])
def test_damaged_folder_refused_in_one_line(tmp_path, damage, message):
    d = tmp_path / "pretrained_model"
    shutil.copytree(fixture("lerobot_tiny_pi0") / "pretrained_model", d)
    pre = json.loads((d / L.PREPROCESSOR).read_text())
    heads = 2
    if damage == "no_preprocessor":
        (d / L.PREPROCESSOR).unlink()
    elif damage == "nan_stat":
        f = next(d.glob("policy_preprocessor_step_*_normalizer_processor.safetensors"))
        stats = {k: np.array(v) for k, v in read_safetensors(f).items()}
        stats["observation.state.mean"][3] = np.nan
        write_safetensors(f, stats)
    elif damage in ("unknown_step", "relative_actions"):
        if damage == "unknown_step":
            pre["steps"].insert(2, {"registry_name": "my_filter", "config": {}})
        else:
            next(s for s in pre["steps"] if s["registry_name"] == "relative_actions_processor")["config"]["enabled"] = True
        (d / L.PREPROCESSOR).write_text(json.dumps(pre))
    elif damage == "truncated":
        data = (d / L.WEIGHTS).read_bytes()
        (d / L.WEIGHTS).write_bytes(data[:-100])
    else:
        heads = None  # width 32 is not LeRobot's So400m: its head count must be given
    with pytest.raises(ValueError, match=message) as e:
        L.load(tmp_path, vision_heads=heads)
    assert "\n" not in str(e.value)


# -------------------------------------------------------------------------------------------------
# Preprocessing against LeRobot's processed arrays (numpy only)
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_preprocessing_matches_lerobot(name):
    root = fixture(name)
    ref = np.load(root / "reference.npz")
    io = L.read_io(root)
    tok = Tokenizer.from_file(root / "tokenizer" / "tokenizer.model")
    batch = {c: ref[f"input/{c}"] for c in io.cameras}
    batch.update({lr.STATE_KEY: ref[f"input/{lr.STATE_KEY}"], lr.TASK_KEY: [str(t) for t in ref["input/task"]]})
    state = lr.normalized_state(io, batch)
    np.testing.assert_allclose(state, ref["processed/observation.state"], atol=1e-6)
    np.testing.assert_allclose(lr.normalize(ref["input/action"], io.normalize[lr.ACTION_KEY]), ref["processed/action"], atol=1e-6)
    assert [io.prompt(t, s) for t, s in zip(batch[lr.TASK_KEY], state)] == list(ref["processed/prompt"])
    if "processed/discretized_state" in ref:
        np.testing.assert_array_equal(discretize_state(state), ref["processed/discretized_state"])
    obs, padded = lr.make_observation(io, tok, batch)
    np.testing.assert_array_equal(obs.tokens, ref["processed/tokens"])
    np.testing.assert_array_equal(obs.token_mask, ref["processed/attention_mask"])
    np.testing.assert_array_equal(obs.image_masks.T, ref["processed/img_masks"])
    for i, cam in enumerate(io.cameras):
        np.testing.assert_allclose(obs.images[:, i].transpose(0, 3, 1, 2), ref[f"processed/images/{cam}"], atol=1e-5)
    assert (padded is None) == ("model/state" not in ref)
    if padded is not None:
        np.testing.assert_allclose(padded, ref["model/state"], atol=1e-6)
    # A camera left out goes last, as -1 with mask False for every row.
    missing = io.cameras[1]
    images, masks, order = lr.camera_images({k: v for k, v in batch.items() if k != missing}, io.cameras, io.image_resolution)
    assert order == tuple(ref["policy_missingcam/camera_order"])
    np.testing.assert_array_equal(masks.T, ref["policy_missingcam/img_masks"])
    np.testing.assert_array_equal(images[:, -1], ref[f"policy_missingcam/images/{missing}"])


def test_uint8_hwc_images_and_lerobot_normalisation_constants():
    rng = np.random.default_rng(0)
    chw = rng.uniform(0, 1, (2, 3, 30, 50)).astype(np.float32)
    u8 = np.round(chw * 255).astype(np.uint8)
    np.testing.assert_allclose(lr.preprocess_image(u8.transpose(0, 2, 3, 1), (28, 28)),
                               lr.preprocess_image(u8.astype(np.float32) / 255, (28, 28)), atol=1e-6)
    out = lr.preprocess_image(chw, (28, 28))  # 30 x 50 -> 16 x 28: 6 rows of padding above, 6 below
    assert out.shape == (2, 3, 28, 28) and (out[:, :, :6] == -1).all() and (out[:, :, 22:] == -1).all()
    q = lr.FeatureNorm(mode="QUANTILES", stats={"q01": np.array([0, 2], np.float32), "q99": np.array([4, 2], np.float32)},
                       eps=1e-8)
    np.testing.assert_allclose(lr.normalize([[2.0, 2.0]], q), [[0.0, -1.0]])  # eps only where q99 == q01
    np.testing.assert_allclose(lr.unnormalize([[1.0, 0.5]], q), [[4.0, 2.0]])
    z = lr.FeatureNorm(mode="MEAN_STD", stats={"mean": np.array([1.0], np.float32), "std": np.array([2.0], np.float32)},
                       eps=0.5)
    np.testing.assert_allclose(lr.normalize([[3.5]], z), [[1.0]])  # (x - mean) / (std + eps)
    np.testing.assert_allclose(lr.unnormalize([[1.0]], z), [[3.0]])  # y * std + mean: no eps
    with pytest.raises(ValueError, match="does not match the checkpoint's 1-dim"):
        lr.normalize([[1.0, 2.0]], z)


# -------------------------------------------------------------------------------------------------
# A folder with other sizes, written here
# -------------------------------------------------------------------------------------------------

_DIMS = dict(D=40, Da=24, L=2, F=56, Fa=40, N=8, K=2, H=8, V=300, W=24, Lv=1, Fv=32, Nv=3, p=7, side=4, A=12)


def _hf_tensors(rng, variant: str, d: dict) -> dict[str, np.ndarray]:
    """Every tensor a LeRobot folder of these sizes holds, under LeRobot's names, written independently of the loader."""
    t = {}

    def lin(name, out, inn, bias=True):
        t[f"model.{name}.weight"] = (rng.standard_normal((out, inn)) / math.sqrt(inn)).astype(np.float32)
        if bias:
            t[f"model.{name}.bias"] = (0.1 * rng.standard_normal(out)).astype(np.float32)

    def vec(name, n):
        t[f"model.{name}"] = (0.1 * rng.standard_normal(n)).astype(np.float32)

    for base, width, mlp, ada in ((_LLM, d["D"], d["F"], False), (_EXP, d["Da"], d["Fa"], variant == "pi05")):
        for i in range(d["L"]):
            pre = f"{base}.layers.{i}"
            lin(f"{pre}.self_attn.q_proj", d["N"] * d["H"], width, False)
            lin(f"{pre}.self_attn.k_proj", d["K"] * d["H"], width, False)
            lin(f"{pre}.self_attn.v_proj", d["K"] * d["H"], width, False)
            lin(f"{pre}.self_attn.o_proj", width, d["N"] * d["H"], False)
            lin(f"{pre}.mlp.gate_proj", mlp, width, False)
            lin(f"{pre}.mlp.up_proj", mlp, width, False)
            lin(f"{pre}.mlp.down_proj", width, mlp, False)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                lin(f"{pre}.{norm}.dense", 3 * width, width) if ada else vec(f"{pre}.{norm}.weight", width)
        lin(f"{base}.norm.dense", 3 * width, width) if ada else vec(f"{base}.norm.weight", width)
    lin(f"{_LLM}.embed_tokens", d["V"], d["D"], False)
    lin("paligemma_with_expert.paligemma.lm_head", d["V"], d["D"], False)
    w, p = d["W"], d["p"]
    t[f"model.{_VIS}.embeddings.patch_embedding.weight"] = rng.standard_normal((w, 3, p, p)).astype(np.float32)
    vec(f"{_VIS}.embeddings.patch_embedding.bias", w)
    lin(f"{_VIS}.embeddings.position_embedding", d["side"] ** 2, w, False)
    for i in range(d["Lv"]):
        pre = f"{_VIS}.encoder.layers.{i}"
        for ln in ("layer_norm1", "layer_norm2"):
            vec(f"{pre}.{ln}.weight", w), vec(f"{pre}.{ln}.bias", w)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            lin(f"{pre}.self_attn.{proj}", w, w)
        lin(f"{pre}.mlp.fc1", d["Fv"], w), lin(f"{pre}.mlp.fc2", w, d["Fv"])
    vec(f"{_VIS}.post_layernorm.weight", w), vec(f"{_VIS}.post_layernorm.bias", w)
    lin(f"{_PG}.multi_modal_projector.linear", d["D"], w)
    lin("action_in_proj", d["Da"], d["A"]), lin("action_out_proj", d["A"], d["Da"])
    if variant == "pi05":
        lin("time_mlp_in", d["Da"], d["Da"]), lin("time_mlp_out", d["Da"], d["Da"])
    else:
        lin("state_proj", d["Da"], d["A"])
        lin("action_time_mlp_in", d["Da"], 2 * d["Da"]), lin("action_time_mlp_out", d["Da"], d["Da"])
    return t


def _write_folder(d, variant: str, dims: dict, rng) -> None:
    """config.json, weights and processor files of a LeRobot policy: 2 cameras + 1 empty one, state 5, action 6,
    MEAN_STD state and action, chunk 4, prompts of 20 tokens."""
    d.mkdir(parents=True)
    side = dims["side"] * dims["p"]
    feats = {"observation.images.top": {"type": "VISUAL", "shape": [3, 30, 40]},
             "observation.images.wrist": {"type": "VISUAL", "shape": [3, side, side]},
             lr.STATE_KEY: {"type": "STATE", "shape": [5]}}
    norm_map = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    (d / "config.json").write_text(json.dumps({
        "type": variant, "input_features": feats, "output_features": {lr.ACTION_KEY: {"type": "ACTION", "shape": [6]}},
        "chunk_size": 4, "n_action_steps": 3, "max_state_dim": dims["A"], "max_action_dim": dims["A"],
        "image_resolution": [side, side], "empty_cameras": 1, "tokenizer_max_length": 20,
        "normalization_mapping": norm_map, "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m"}))
    write_safetensors(d / L.WEIGHTS, _hf_tensors(rng, variant, dims))
    stats = {f"{k}.{s}": rng.uniform(0.5, 2.0, n).astype(np.float32) for k, n in ((lr.STATE_KEY, 5), (lr.ACTION_KEY, 6))
             for s in ("mean", "std")}
    write_safetensors(d / "pre_stats.safetensors", stats)
    write_safetensors(d / "post_stats.safetensors", {k: v for k, v in stats.items() if k.startswith(lr.ACTION_KEY)})
    norm = {"eps": 1e-8, "features": {**feats, lr.ACTION_KEY: {"type": "ACTION", "shape": [6]}}, "norm_map": norm_map}
    pre = [{"registry_name": "to_batch_processor", "config": {}},
           {"registry_name": L._PROMPT_STEP[variant], "config": {}},
           {"registry_name": "tokenizer_processor", "config": {"max_length": 20, "tokenizer_name": "tok"}},
           {"registry_name": "normalizer_processor", "config": norm, "state_file": "pre_stats.safetensors"}]
    post = [{"registry_name": "unnormalizer_processor", "config": {**norm, "features": {lr.ACTION_KEY: norm["features"][lr.ACTION_KEY]}},
             "state_file": "post_stats.safetensors"}]
    (d / L.PREPROCESSOR).write_text(json.dumps({"steps": pre}))
    (d / L.POSTPROCESSOR).write_text(json.dumps({"steps": post}))


@pytest.mark.parametrize("variant", ["pi05", "pi0"])
def test_other_sizes_come_from_the_tensors(tmp_path, variant):
    dims = _DIMS
    _write_folder(tmp_path / "pretrained_model", variant, dims, np.random.default_rng(1))
    ck = L.load(tmp_path, vision_heads=dims["Nv"])
    c, io = ck.config, ck.io
    assert (c.vlm.width, c.action_expert.width, c.vlm.depth, c.vlm.mlp_dim, c.action_expert.mlp_dim) == (
        dims["D"], dims["Da"], dims["L"], dims["F"], dims["Fa"])
    assert (c.vlm.num_heads, c.vlm.num_kv_heads, c.vlm.head_dim, c.action_expert.num_kv_heads) == (
        dims["N"], dims["K"], dims["H"], dims["K"])
    assert (c.siglip.width, c.siglip.num_heads, c.siglip.patch_size, c.siglip.image_size, c.siglip.mlp_dim) == (
        dims["W"], dims["Nv"], dims["p"], dims["side"] * dims["p"], dims["Fv"])
    assert (c.vocab_size, c.action_dim, c.variant) == (dims["V"], dims["A"], variant)
    assert io.cameras == ("observation.images.top", "observation.images.wrist", "observation.images.empty_camera_0")
    assert (io.state_dim, io.action_dim, io.chunk_size, io.n_action_steps, io.empty_cameras) == (5, 6, 4, 3, 1)
    assert {k: n.mode for k, n in io.normalize.items() if n.mode != "IDENTITY"} == {lr.STATE_KEY: "MEAN_STD",
                                                                                  lr.ACTION_KEY: "MEAN_STD"}
    # The layout of every projection, as its PyTorch module computes it (2 KV heads, 3 SigLIP heads).
    t = {k.removeprefix("model."): v for k, v in read_safetensors(tmp_path / "pretrained_model" / L.WEIGHTS).items()}
    rng = np.random.default_rng(2)
    x, p = rng.standard_normal(dims["D"]).astype(np.float32), ck.params
    pre = f"{_LLM}.layers.1.self_attn"
    np.testing.assert_allclose(np.einsum("d,ndh->nh", x, p.vlm.layers.q[1]),
                               (t[f"{pre}.q_proj.weight"] @ x).reshape(dims["N"], dims["H"]), atol=1e-5)
    for j, proj in enumerate(("k_proj", "v_proj")):
        np.testing.assert_allclose(np.einsum("d,kdh->kh", x, p.vlm.layers.kv[1, j]),
                                   (t[f"{pre}.{proj}.weight"] @ x).reshape(dims["K"], dims["H"]), atol=1e-5)
    a = rng.standard_normal((dims["N"], dims["H"])).astype(np.float32)
    np.testing.assert_allclose(np.einsum("nh,nhd->d", a, p.vlm.layers.out[1]), t[f"{pre}.o_proj.weight"] @ a.reshape(-1),
                               atol=1e-5)
    g = np.einsum("d,gdf->gf", x, p.vlm.layers.gating[1])
    np.testing.assert_allclose(g, np.stack([t[f"{_LLM}.layers.1.mlp.{n}_proj.weight"] @ x for n in ("gate", "up")]), atol=1e-5)
    xv, vis = rng.standard_normal(dims["W"]).astype(np.float32), f"{_VIS}.encoder.layers.0.self_attn"
    q = p.siglip.layers.query
    np.testing.assert_allclose(np.einsum("w,wnh->nh", xv, q.kernel[0]) + q.bias[0],
                               (t[f"{vis}.q_proj.weight"] @ xv + t[f"{vis}.q_proj.bias"]).reshape(dims["Nv"], -1), atol=1e-5)
    patch = rng.standard_normal((3, dims["p"], dims["p"])).astype(np.float32)  # one conv window, CHW
    np.testing.assert_allclose(np.einsum("pqc,pqcw->w", patch.transpose(1, 2, 0), p.siglip.patch.kernel),
                               np.einsum("cpq,wcpq->w", patch, t[f"{_VIS}.embeddings.patch_embedding.weight"]), atol=1e-4)


# -------------------------------------------------------------------------------------------------
# Parity: prefix K/V and actions after 3 steps against LeRobot's own
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_prefix_kv_and_three_step_actions_match_lerobot(name):
    root = fixture(name)
    ref = np.load(root / "reference.npz")
    ck = _load(root)
    images = np.stack([ref[f"processed/images/{c}"] for c in ck.io.cameras], 1).transpose(0, 1, 3, 4, 2)
    obs = Observation(images=images, image_masks=ref["model/img_masks"].T, tokens=ref["processed/tokens"],
                      token_mask=ref["processed/attention_mask"])
    cache = model.prefill(ck.params, jax.device_put(obs))
    valid = ref["prefix/pad_masks"]
    for kv, atol in (("k", 1e-3), ("v", 5e-4)):  # ours [L, B, P, K, H]; LeRobot's [L, B, K, P, H]
        ours = np.asarray(getattr(cache, kv)).transpose(1, 2, 0, 3, 4)[valid]
        np.testing.assert_allclose(ours, ref[f"prefix/kv_{kv}"].transpose(1, 3, 0, 2, 4)[valid], atol=atol)
    state = ref["model/state"] if "model/state" in ref else None
    actions = model.denoise(ck.params, cache, ref["sample/noise"], 3, state)
    np.testing.assert_allclose(actions, ref["sample/actions_num_steps_3"], atol=2e-4)


def test_eval_parity_dispatches_a_lerobot_policy_folder(tmp_path, monkeypatch):
    from eval.parity import __main__ as parity_cli
    from eval.parity import lerobot_policy

    (tmp_path / "pretrained_model").mkdir()
    np.savez(tmp_path / "reference.npz", x=np.zeros(1))
    calls = []
    monkeypatch.setattr(lerobot_policy, "main", lambda argv: calls.append(argv) or 0)
    assert parity_cli.main([str(tmp_path)]) == 0 and calls == [[str(tmp_path)]]


@pytest.mark.parametrize("name", FIXTURES)
def test_preprocess_adapter_gives_lerobots_rows(name):
    """`LeRobotPreprocess` (what robots.io applies to client samples): a uint8 HWC image, the state, the prompt
    and the chunk back, against the same fixture arrays."""
    root = fixture(name)
    ref = np.load(root / "reference.npz")
    io = L.read_io(root)
    pre = lr.LeRobotPreprocess(io)
    tok = Tokenizer.from_file(root / "tokenizer" / "tokenizer.model")
    state = pre.normalize_state(ref[f"input/{lr.STATE_KEY}"][0])
    np.testing.assert_allclose(state, ref["processed/observation.state"][0], atol=1e-6)
    ids, mask = pre.prompt(tok, str(ref["input/task"][1]), pre.normalize_state(ref[f"input/{lr.STATE_KEY}"][1]),
                           io.tokenizer_max_length)
    np.testing.assert_array_equal(ids, ref["processed/tokens"][1])
    np.testing.assert_array_equal(mask, ref["processed/attention_mask"][1])
    cam = io.cameras[0]
    u8 = np.round(ref[f"input/{cam}"][0] * 255).astype(np.uint8).transpose(1, 2, 0)
    want = ref[f"processed/images/{cam}"][0].transpose(1, 2, 0)  # from float pixels: uint8 rounding, doubled, apart
    np.testing.assert_allclose(pre.pixels(u8, io.image_resolution[0]), want, atol=1 / 255 + 1e-5)
    padded = np.zeros((io.chunk_size, io.max_action_dim), np.float32)
    padded[:, :io.action_dim] = ref["policy/actions_model"][0]
    padded[:, io.action_dim:] = 7.0
    out = pre.unnormalize_actions(padded)
    np.testing.assert_allclose(out[:, :io.action_dim], ref["policy/actions"][0], atol=1e-5)
    assert (out[:, io.action_dim:] == 7.0).all()


# -------------------------------------------------------------------------------------------------
# Quantized: the robot I/O travels with the weights
# -------------------------------------------------------------------------------------------------


def test_a_quantized_lerobot_policy_keeps_its_statistics_chunk_prompt_length_and_tokenizer(tmp_path, capsys):
    from oxygen_jax.ckpts.load import load_model
    from oxygen_jax.ckpts.adapters import base_fingerprint
    from oxygen_jax.quantize import main as quantize_main, quantize_checkpoint

    policy = tmp_path / "policy"
    _write_folder(policy / "pretrained_model", "pi0", _DIMS, np.random.default_rng(3))
    (policy / "tokenizer").mkdir()
    (policy / "tokenizer" / "tokenizer.model").write_bytes(b"its own tokenizer")
    heads = ["--vision-heads", str(_DIMS["Nv"])]
    assert quantize_main(["--ckpt", str(policy), "--out", str(tmp_path / "q"), "--weights", "int8", *heads]) == 0
    out = capsys.readouterr().out
    assert "robot I/O (its processor files) copied" in out and "restored whole" not in out  # converted leaf by leaf
    whole = quantize_checkpoint(policy, tmp_path / "whole", "int8", stream=False, vision_heads=_DIMS["Nv"])
    assert not whole["streamed"] and base_fingerprint(tmp_path / "whole") == base_fingerprint(tmp_path / "q")
    src, q = load_model(policy, family="pi05", vision_heads=_DIMS["Nv"]), load_model(tmp_path / "q", family="pi05")
    assert type(q.io.preprocess) is type(src.io.preprocess) is lr.LeRobotPreprocess
    assert (q.io.action_horizon, q.io.prompt_len) == (src.io.action_horizon, src.io.prompt_len) == (4, 20)
    a, b = src.io.preprocess.io, q.io.preprocess.io
    assert (a.cameras, a.state_dim, a.action_dim, a.n_action_steps) == (b.cameras, b.state_dim, b.action_dim, b.n_action_steps)
    for side in ("normalize", "unnormalize"):
        ours, theirs = getattr(b, side), getattr(a, side)
        assert ours.keys() == theirs.keys()
        for k in ours:
            assert ours[k].mode == theirs[k].mode and all(np.array_equal(ours[k].stats[s], theirs[k].stats[s])
                                                          for s in theirs[k].stats)
    assert q.io.tokenizer.read_bytes() == b"its own tokenizer" and "LeRobot π0 robot I/O" in q.what
    # Laid out like the Hugging Face cache (every file a link to a blob): the I/O is carried as files.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for f in sorted((policy / "pretrained_model").iterdir()):
        f.rename(blobs / f.name)
        f.symlink_to(blobs / f.name)
    assert quantize_main(["--ckpt", str(policy), "--out", str(tmp_path / "q2"), "--weights", "int8", *heads]) == 0
    carried = tmp_path / "q2" / L.IO_FOLDER
    assert not any(f.is_symlink() for f in carried.iterdir()) and {f.name for f in carried.iterdir()} == {
        "config.json", L.PREPROCESSOR, L.POSTPROCESSOR, "pre_stats.safetensors", "post_stats.safetensors"}
    # A statistics file the normaliser names but the folder lacks: refused before anything is written.
    (policy / "pretrained_model" / "post_stats.safetensors").unlink()
    capsys.readouterr()
    assert quantize_main(["--ckpt", str(policy), "--out", str(tmp_path / "q3"), "--weights", "int8", *heads]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "post_stats.safetensors, which the folder lacks" in err, err
    assert not (tmp_path / "q3").exists()
