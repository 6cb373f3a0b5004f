"""StarVLA's own QwenPI_v3 / QwenGR00T (../shared/fixtures/starvla_*_tiny): restored from their native
checkpoint layout and matched to 1e-4 on every reference array, in both layer layouts; restored through
the public loader, `Engine` steps each with a language request on the same prefix and its chunk equals
the fixture's actions, bit-identical to the same program without the request."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from eval.parity import starvla as parity
from oxygen_jax.ckpts import starvla
from oxygen_jax.ckpts.load import load_model, source_kind
from oxygen_jax.ckpts.safetensors import read_safetensors, write_safetensors
from oxygen_jax.runtime.engine import Engine, EngineConfig
from oxygen_jax.models.vla import MultiHead

SHARED = Path(os.environ.get("OXYGEN_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
FIXTURES = {"QwenPI_v3": SHARED / "fixtures" / "starvla_qwenpi_v3_tiny", "QwenGR00T": SHARED / "fixtures" / "starvla_gr00t_tiny"}


def _need(path: Path) -> Path:
    if not path.is_dir():
        pytest.skip(f"fixture {path} absent (../shared not checked out)")
    return path


@pytest.mark.parametrize("framework", sorted(FIXTURES))
def test_every_fixture_array_matches_starvla_in_both_layouts(framework):
    ck, rows = parity.run_fixture(_need(FIXTURES[framework]))
    assert ck.framework == framework
    failed = [(r.quantity, r.layout, r.max_abs) for r in rows if not r.ok]
    assert not failed, failed
    assert {r.layout for r in rows} == {"stacked", "unstacked"} and len(rows) >= 60


def test_the_transformers_5_convention_misses_gr00t(tmp_path):
    """The check can fail: GR00T on transformers-5 hidden states (post-norm last entry) is off by far more than 1e-4."""
    import jax
    import jax.numpy as jnp

    from oxygen_jax.models import mot

    ck = starvla.load(_need(FIXTURES["QwenGR00T"]))
    ref = dict(np.load(FIXTURES["QwenGR00T"] / "reference.npz"))
    head = ck.spec.heads[0].replace(hidden_states=None)
    spec = ck.spec.replace(backbone=ck.spec.backbone.replace(hidden_states="transformers_5"), heads=(head,))
    inputs = parity.inputs_from_reference(spec, ref)
    st, _ = parity._head_prepare(spec, ck.params, inputs, jnp.asarray(ref["state"][:, 0]))
    actions = np.asarray(parity._denoise(spec, ck.params, st, jnp.asarray(ref["noise"])))
    assert np.max(np.abs(actions - ref["actions"])) > 1e-2
    with pytest.raises(ValueError, match="trained on transformers_4_57 hidden states, but the backbone reports transformers_5"):
        mot.ModelSpec(backbone=spec.backbone, heads=ck.spec.heads, language=False, image_token_id=spec.image_token_id)
    del jax


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def loaded(request):
    """(framework, the public loader's model, reference arrays), once per fixture for this module."""
    path = _need(FIXTURES[request.param])
    return request.param, load_model(path, family="multihead"), dict(np.load(path / "reference.npz"))


def test_public_loader_detects_starvla_and_keeps_a_language_decoder(loaded):
    framework, m, _ = loaded
    assert source_kind(FIXTURES[framework]) == "starvla"
    assert m.source == "starvla" and m.config.language and m.config.names == (starvla.HEAD_NAMES[framework],)


def test_engine_steps_the_restored_model_with_a_language_request_and_matches_the_fixture(loaded):
    framework, m, ref = loaded
    vla = MultiHead(m.params, m.config)
    name = m.config.names[0]
    inputs = parity.inputs_from_reference(m.config, ref)
    noises = {name: ref["noise"]}
    states = {n: ref["state"][:, 0] for n in vla.state_dims()}  # GR00T's state token; QwenPI_v3 has none
    assert bool(states) == (framework == "QwenGR00T")
    cfg = EngineConfig(num_slots=2, max_new_tokens=4, admissions_per_frame=1, tokens_per_frame=2)
    eng = Engine(vla, cfg)
    eng.submit(max_tokens=4, stop_ids=(), row=1)  # decodes on row 1's (left-padded) prefix
    res = eng.step(inputs, noises, states=states or None)
    assert res.batch == 1  # the request decoded in this frame
    tol = parity.ATOL + parity.ATOL * float(np.max(np.abs(ref["actions"])))  # the fixture's atol = rtol = 1e-4
    np.testing.assert_allclose(res.head_actions[name], ref["actions"], rtol=0, atol=tol)
    alone = Engine(vla, cfg).step(inputs, noises, states=states or None)  # the same program, no request
    assert alone.batch == 0
    np.testing.assert_array_equal(res.head_actions[name], alone.head_actions[name])


def _copy(src: Path, dst: Path, edit=None) -> Path:
    dst.mkdir()
    for f in ("config.yaml", "vlm_config.json", "meta.json"):
        shutil.copy(src / f, dst / f)
    tensors = {k: np.array(v) for k, v in read_safetensors(src / "model.safetensors").items()}
    write_safetensors(dst / "model.safetensors", edit(tensors) if edit else tensors)
    return dst


def test_missing_misshaped_and_wrong_family_fail_in_one_line(tmp_path):
    src = _need(FIXTURES["QwenGR00T"])

    def drop(t):
        t.pop("action_model.model.transformer_blocks.1.ff.net.2.bias")
        return t

    def reshape(t):
        t["action_model.action_decoder.layer2.weight"] = t["action_model.action_decoder.layer2.weight"][:5]
        return t

    for name, edit, pattern in (("missing", drop, r"missing 1: action_model\.model\.transformer_blocks\.1\.ff\.net\.2\.bias"),
                                ("misshaped", reshape, r"mis-shaped 1: action_model\.action_decoder\.layer2\.weight \(5, 48\)")):
        with pytest.raises(ValueError, match=pattern) as e:
            starvla.load(_copy(src, tmp_path / name, edit))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="a QwenGR00T checkpoint, not QwenPI_v3"):
        starvla.load(src, framework="QwenPI_v3")
    hf_dir = SHARED / "fixtures" / "qwen3vl_tiny"
    if hf_dir.is_dir():
        with pytest.raises(ValueError, match=r"not a StarVLA checkpoint: no config\.yaml \(a Hugging Face checkpoint"):
            starvla.load(hf_dir)


def test_unnormalize_actions_clips_thresholds_the_gripper_and_rescales_where_masked():
    stats = starvla.action_stats({"libero": {"action": {"q01": [-2.0] * 7, "q99": [2.0] * 7, "mask": [True] * 6 + [False]}}})
    out = starvla.unnormalize_actions(np.asarray([[0.5, 3.0, -1.0, 0.0, 0.0, 0.0, 0.7]]), stats)
    np.testing.assert_allclose(out, [[1.0, 2.0, -2.0, 0.0, 0.0, 0.0, 1.0]])
