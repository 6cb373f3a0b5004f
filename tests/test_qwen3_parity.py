"""Hugging Face parity of the Qwen3 / Qwen3-VL backbones, and HF checkpoint loading.

The parity tests read ../shared/fixtures/qwen3_tiny and qwen3vl_tiny (made by transformers) and skip
visibly when they are absent; the loading tests build their own checkpoints.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval.parity import hf as parity_hf
from helpers import fixture, shared_dir
from oxygen_jax.models import backbone as bb
from oxygen_jax.ckpts import hf as hf_checkpoint
from oxygen_jax.ckpts.safetensors import read_checkpoint_tensors, read_safetensors, write_safetensors
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.pi05.params import to_openpi_dict


_fixture = fixture  # path or a visible skip


@pytest.fixture(scope="module")
def qwen3_rows():
    return parity_hf.run_fixture(_fixture("qwen3_tiny"))[1]


@pytest.fixture(scope="module")
def qwen3vl_rows():
    return parity_hf.run_fixture(_fixture("qwen3vl_tiny"))[1]


def _assert_all_pass(rows, required):
    failed = [f"{r.quantity}: {r.max_abs:.3g} ({r.tol})" for r in rows if not r.ok]
    assert not failed, failed
    names = {r.quantity for r in rows}
    missing = [q for q in required if q not in names]
    assert not missing, f"quantities not compared: {missing}"


def test_qwen3_logits_kv_hidden_states_and_left_padded_greedy_decode_match_hf(qwen3_rows):
    _assert_all_pass(qwen3_rows, [
        "position_ids (real tokens)", "logits (real tokens)", "k_cache (real tokens, all layers)",
        "v_cache (real tokens, all layers)", "hidden_states (emb, layers pre-DeepStack, final norm)",
        "final_hidden (real tokens)", "greedy tokens, cached decode (8 steps, left padding)", "decode step logits",
    ])
    assert all(r.max_abs <= 1e-4 for r in qwen3_rows)


def test_qwen3vl_vision_deepstack_mrope_and_decode_match_hf(qwen3vl_rows):
    _assert_all_pass(qwen3vl_rows, [
        "pixel_values (patchify raw images)", "vision/vit_last_hidden", "vision/merged_tokens", "vision/deepstack_features",
        "mrope position_ids (real tokens)", "rope_deltas", "image token mask (mm_token_type_ids)", "logits (real tokens)",
        "k_cache (real tokens, all layers)", "v_cache (real tokens, all layers)",
        "hidden_states (emb, layers pre-DeepStack, final norm)", "greedy tokens, cached decode (8 steps, left padding)",
        "decode position ids",
    ])


def test_fixture_kind_is_recognised_from_its_files():
    q3, q3vl = _fixture("qwen3_tiny"), _fixture("qwen3vl_tiny")
    assert parity_hf.is_hf_fixture(q3) and parity_hf.is_hf_fixture(q3vl)
    assert not parity_hf.is_hf_fixture(shared_dir() / "fixtures" / "openpi_tiny_pi05")
    names = read_checkpoint_tensors(q3vl).keys()
    assert hf_checkpoint.detect_family(json.loads((q3vl / "config.json").read_text()), names) == "qwen3_vl"
    assert hf_checkpoint.detect_family({}, read_checkpoint_tensors(q3).keys()) == "qwen3"
    with pytest.raises(ValueError, match="config.json says 'qwen3' but the tensors look like 'qwen3_vl'"):
        hf_checkpoint.detect_family({"model_type": "qwen3"}, names)


def test_loading_one_family_with_another_familys_spec_fails_in_one_line_naming_the_tensors(tiny_params):
    qwen3 = hf_checkpoint.to_hf(bb.preset("qwen3_tiny"), bb.init_decoder(bb.preset("qwen3_tiny")))  # qwen3_tiny's names
    with pytest.raises(ValueError) as err:
        hf_checkpoint.from_hf(bb.preset("qwen3vl_tiny"), qwen3)
    msg = str(err.value)
    assert "\n" not in msg and "qwen3_vl spec" in msg
    assert "missing 92: model.language_model.embed_tokens.weight" in msg
    assert "model.language_model.layers.{0..2}.self_attn.q_norm.weight" in msg and "model.visual.pos_embed.weight" in msg
    assert "unexpected 35: model.embed_tokens.weight" in msg

    openpi = {k: np.asarray(v) for k, v in to_openpi_dict(tiny_params).items()}  # a π0.5 openpi tree
    with pytest.raises(ValueError) as err:
        hf_checkpoint.from_hf(bb.preset("qwen3_tiny"), openpi)
    msg = str(err.value)
    assert "\n" not in msg and "lm_head.weight" in msg and "PaliGemma/llm/layers/attn/q_einsum/w" in msg


# --------------------------------------------------------------------------------------------------
# Checkpoints the fixtures do not cover (built here): other dims, untied VL head, other sections / DeepStack


def _unseen_spec() -> bb.BackboneSpec:
    """Qwen3-VL with dims no fixture has: untied head, head_dim 8 with sections (2, 1, 1), 2 KV heads of 3
    query heads, DeepStack from ViT block 1 into LLM layer 0 only, merge 2, a 4 x 4 position grid."""
    return bb.BackboneSpec(
        family="qwen3_vl", width=48, depth=2, num_heads=6, num_kv_heads=2, head_dim=8, mlp_dim=80, vocab_size=300,
        mlp="swiglu", norm_plus_one=False, qk_norm=True,
        rope=bb.RopeSpec(theta=1e5, kind="mrope_interleaved", mrope_section=(2, 1, 1)), embed_scale=False,
        tie_embeddings=False, vision=bb.Qwen3VisionSpec(depth=2, width=24, num_heads=2, mlp_dim=40, out_width=48,
                                                       num_position_embeddings=16, deepstack_layers=(1,)),
    )


def test_hf_config_and_names_round_trip_for_every_preset_and_the_published_4b_config():
    for spec in (bb.preset("qwen3_tiny"), bb.preset("qwen3vl_tiny"), bb.preset("qwen3_vl_4b"), _unseen_spec()):
        assert hf_checkpoint.spec_from_config(hf_checkpoint.config_from_spec(spec)) == spec
    # Fields as published in Qwen/Qwen3-VL-4B-Instruct's config.json (transformers 4.57 layout: rope_theta + rope_scaling).
    published = {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
        "tie_word_embeddings": True,
        "text_config": {"attention_bias": False, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
                        "intermediate_size": 9728, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
                        "rms_norm_eps": 1e-06, "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                        "rope_theta": 5000000, "tie_word_embeddings": True, "vocab_size": 151936},
        "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024,
                          "in_channels": 3, "intermediate_size": 4096, "num_heads": 16, "num_position_embeddings": 2304,
                          "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }
    assert hf_checkpoint.spec_from_config(published) == bb.preset("qwen3_vl_4b")
    names = hf_checkpoint.hf_shapes(bb.preset("qwen3_vl_4b"))
    assert names["model.visual.patch_embed.proj.weight"] == (1024, 3, 2, 16, 16) and "lm_head.weight" not in names
    assert len(names) == 36 * 11 + 2 + 3 + 24 * 12 + 6 + 3 * 6
    with pytest.raises(ValueError, match="non-interleaved M-RoPE"):
        hf_checkpoint.spec_from_config({**published, "text_config": {**published["text_config"], "rope_scaling": {"mrope_section": [24, 20, 20]}}})


@pytest.fixture(scope="module")
def unseen_fixture(tmp_path_factory):
    """An HF-layout directory for `_unseen_spec` (config.json, bf16 + f32 safetensors shards) and a reference
    whose greedy tokens come from a cache-free recompute, with one image row and one text-only left-padded row."""
    spec = _unseen_spec()
    vspec = spec.vision
    decoder, vision = bb.init_decoder(spec, seed=5), qwen3_vl.init_vision(vspec, seed=6)
    path = tmp_path_factory.mktemp("qwen3vl_unseen")
    tensors = hf_checkpoint.to_hf(spec, decoder, vision)
    visual = {k: v for k, v in tensors.items() if k.startswith("model.visual.")}
    text = {k: v for k, v in tensors.items() if k not in visual}
    write_safetensors(path / "model-00001-of-00002.safetensors", visual)
    write_safetensors(path / "model-00002-of-00002.safetensors", text)
    index = {"weight_map": {**{k: "model-00001-of-00002.safetensors" for k in visual}, **{k: "model-00002-of-00002.safetensors" for k in text}}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    img = 290
    (path / "config.json").write_text(json.dumps(hf_checkpoint.config_from_spec(spec, image_token_id=img)))

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (64, 32, 3), dtype=np.uint8)
    pixels, grid = qwen3_vl.patchify(image, vspec)  # 4 x 2 patches -> 2 x 1 tokens
    ids = np.asarray([[5, 6, img, img, 7, 8], [0, 0, 0, 9, 10, 11]], np.int32)
    mask = ids > 0
    n = 5
    # The same compiled programs (same shapes, same float32 matmul precision) as `parity_hf.main` uses later.
    with jax.default_matmul_precision("float32"):
        enc = parity_hf._encode(vspec, vision, pixels, (grid,))
        x, image_mask, deepstack = parity_hf._embed_images(spec, decoder, ids, enc["tokens"], enc["deepstack"], img)
        positions, nxt = qwen3_vl.mrope_positions(ids, mask, [grid], image_token_id=img, spatial_merge_size=2)

        # Cache-free greedy reference: re-run the whole [prompt | generated] sequence for every token.
        b, t = ids.shape
        pos = np.concatenate([positions, np.broadcast_to(qwen3_vl.decode_positions(nxt, n), (3, b, n))], -1)
        ds = np.pad(np.asarray(deepstack), [(0, 0), (0, 0), (0, n), (0, 0)])
        gen = np.zeros((b, n), np.int32)
        for j in range(n):
            seq = np.concatenate([np.asarray(x), np.asarray(decoder.embedding)[gen]], 1)
            m = np.concatenate([mask, np.arange(n)[None].repeat(b, 0) < j], 1)
            logits = parity_hf._forward(spec, decoder, seq, pos, m, ds)["logits"]
            gen[:, j] = np.argmax(np.asarray(logits[:, t - 1 + j]), -1)
    np.savez(path / "reference.npz", input_ids=ids, attention_mask=mask.astype(np.int32), pixel_values=pixels,
             image_grid_thw=np.asarray([grid]), images_row0_uint8=image, gen_tokens=gen,
             decode_position_ids=qwen3_vl.decode_positions(nxt, n), mm_token_type_ids=image_mask.astype(np.int32),
             position_ids=positions, vision_tokens=np.asarray(enc["tokens"]))
    return path, spec, decoder, vision


def test_unseen_checkpoint_loads_from_its_own_files_with_identical_weights(unseen_fixture):
    path, spec, decoder, vision = unseen_fixture
    assert parity_hf.is_hf_fixture(path)
    ck = hf_checkpoint.load(path)
    assert ck.spec == spec and ck.config["image_token_id"] == 290
    for ours, theirs in ((ck.decoder, decoder), (ck.vision, vision)):
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_array_equal(a, b)
    bf16 = {k: v.astype(jnp.bfloat16) for k, v in hf_checkpoint.to_hf(spec, decoder).items()}
    write_safetensors(path / "bf16.safetensors", bf16)
    back = read_safetensors(path / "bf16.safetensors")
    assert all(back[k].dtype == jnp.bfloat16 and np.array_equal(back[k], bf16[k]) for k in bf16)


def test_parity_command_runs_on_an_unseen_fixture_and_exits_nonzero_on_a_mismatch(unseen_fixture, capsys):
    """Untied head, other sections and DeepStack indices, a text-only row: the cached decode equals the
    cache-free recompute (exact tokens), and a corrupted reference turns the exit status to 1."""
    path = unseen_fixture[0]
    assert parity_hf.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "[qwen3_vl]" in out and "untied head" in out and "| greedy tokens, cached decode (5 steps, left padding) | 0 |" in out
    ref = dict(np.load(path / "reference.npz"))
    ref["gen_tokens"] = (ref["gen_tokens"] + 1) % 300
    np.savez(path / "reference.npz", **ref)
    assert parity_hf.main([str(path)]) == 1
    assert "FAIL" in capsys.readouterr().out
