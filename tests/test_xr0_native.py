"""Xiaomi-Robotics-0 restored from its released layout matches the native `MiBoTForActionGeneration`.

The specification (../shared/fixtures/xr0_tiny, made by the native code; skipped, naming the path, when
../shared is absent):

* every reference array is reproduced within 1e-4 in both layer layouts (`eval.parity.xr0`);
* `load_model` recognises the XR0 directory; `Engine` steps the restored model with a language request
  in flight and each row's chunk equals the fixture's (per-row masks: one head per robot mask, the same
  weights); the chunks are bit-identical without the request; the action mask is applied (a head without
  it misses the fixture by far more than the tolerance);
* one tensor missing, one mis-shaped, another family's directory: one-line errors naming what is wrong.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from helpers import shared_dir

from eval.parity import xr0 as parity_xr0
from oxygen_jax.ckpts import hf, xr0
from oxygen_jax.ckpts.load import load_model, source_kind
from oxygen_jax.ckpts.safetensors import read_checkpoint_tensors, write_safetensors
from oxygen_jax.models import heads as hd
from oxygen_jax.runtime.engine import Engine, EngineConfig
from oxygen_jax.models.vla import MultiHead

ATOL = 1e-4


def _fixture(name: str = "xr0_tiny"):
    path = shared_dir() / "fixtures" / name
    if not path.is_dir():
        pytest.skip(f"../shared fixtures not present: {path} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    return path


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(_fixture() / "reference.npz"))


@pytest.fixture(scope="module")
def rows():
    return parity_xr0.run_fixture(_fixture())[1]


def test_every_fixture_array_matches_in_both_layer_layouts(rows):
    failed = [f"{r.quantity} [{r.layout}] {r.max_abs:.3g}" for r in rows if not r.ok]
    assert not failed, failed
    names = {r.quantity for r in rows}
    for want in ("k_cache", "v_cache", "velocities", "actions (heads.denoise)", "train_loss", "dit_position_ids",
                 "time_mod (per step)", "dit_layer_out_step0", "train_velocity_deploy"):
        assert any(n.startswith(want) for n in names), want
    assert {r.layout for r in rows} >= {"stacked", "unstacked"}


@pytest.fixture(scope="module")
def loaded():
    m = load_model(_fixture())
    assert m.source == "xr0" and m.family == "multihead" and m.config.language
    return m


def _per_row_model(loaded, ref) -> MultiHead:
    """One head per row's robot mask, the same weights: row b's chunk is read from head b; "ones" has no mask."""
    spec, params = loaded.config, loaded.params
    h = spec.heads[0]
    masks = [xr0._mask_rows(m) for m in ref["action_mask"]]
    heads = tuple(h.replace(name=f"xr0_row{b}", action_mask=m) for b, m in enumerate(masks)) + (h.replace(name="ones"),)
    return MultiHead(params.__class__(decoder=params.decoder, vision=params.vision,
                                      heads={x.name: params.heads[h.name] for x in heads}),
                     spec.replace(heads=heads))


def test_load_model_restores_xr0_and_engine_steps_it_with_a_language_request(loaded, ref):
    assert source_kind(_fixture()) == "xr0"
    vla = _per_row_model(loaded, ref)
    inputs = parity_xr0.fixture_inputs(vla.spec, ref)
    b = ref["state"].shape[0]
    noises = {n: ref["noise"] for n in vla.heads}
    states = {n: ref["state"][:, 0] for n in vla.heads}
    cfg = EngineConfig(num_slots=2, max_new_tokens=4, admissions_per_frame=1, tokens_per_frame=2)
    eng = Engine(vla, cfg)
    eng.submit(max_tokens=4, stop_ids=(), row=1)
    res = eng.step(inputs, noises, states=states)
    assert res.batch == 1  # the request decoded in this frame
    for r in range(b):
        np.testing.assert_allclose(res.head_actions[f"xr0_row{r}"][r], ref["actions"][r], rtol=0, atol=ATOL,
                                   err_msg=f"row {r}")
    # The native runtime multiplies x by the robot's mask at every step: ignoring it moves the actions by ~0.7.
    assert np.max(np.abs(res.head_actions["ones"] - ref["actions"])) > 0.1
    alone = Engine(vla, cfg).step(inputs, noises, states=states)  # the same program, no request
    assert alone.batch == 0
    for n in vla.heads:
        np.testing.assert_array_equal(res.head_actions[n], alone.head_actions[n])


def _copy_with(tmp_path, tensors):
    d = tmp_path / "xr0"
    d.mkdir()
    shutil.copy(_fixture() / "config.json", d / "config.json")
    write_safetensors(d / "model.safetensors", tensors)
    return d


def test_a_missing_or_mis_shaped_tensor_is_one_line_naming_it(tmp_path, loaded):
    tensors = dict(read_checkpoint_tensors(_fixture()))
    spec = loaded.config
    dropped = {k: v for k, v in tensors.items() if k != "dit.layers.1.attn.q_norm.weight"}
    with pytest.raises(ValueError, match=r"missing 1: dit\.layers\.1\.attn\.q_norm\.weight$") as e:
        load_model(_copy_with(tmp_path, dropped))
    assert "\n" not in str(e.value)
    bad = dict(tensors, **{"sink.weight": np.zeros((2, 32), np.float32)})
    with pytest.raises(ValueError, match=r"mis-shaped 1: sink\.weight \(2, 32\) \(expected \(1, 32\)\)"):
        xr0.from_native(spec, bad)
    extra = dict(tensors, **{"dit.layers.2.adaln_table": np.zeros((6, 32), np.float32)})
    with pytest.raises(ValueError, match=r"unexpected 1: dit\.layers\.2\.adaln_table"):
        xr0.from_native(spec, extra)
    xr0.from_native(spec, dict(tensors, **{"vlm.lm_head.weight": tensors["vlm.model.language_model.embed_tokens.weight"]}))


def test_another_family_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"not an XR0 checkpoint: config\.json has model_type 'qwen3_vl'"):
        xr0.load(_fixture("qwen3vl_tiny"))
    with pytest.raises(ValueError, match=r"not an XR0 checkpoint: it has config\.yaml"):
        xr0.load(_fixture("starvla_qwenpi_v3_tiny"))
    with pytest.raises(ValueError, match=r"not a Qwen3 / Qwen3-VL checkpoint: config\.json model_type is 'mibot'"):
        hf.load(_fixture())
    with pytest.raises(ValueError, match=r"XR0 checkpoint with its own head"):
        load_model(_fixture(), heads=(hd.preset("xr0_tiny"),))


def test_the_horizon_comes_from_the_action_mask_and_mask_shapes_are_checked(ref):
    tensors = read_checkpoint_tensors(_fixture())
    config = xr0.read_config(_fixture())
    mask = xr0.robot_action_mask(5, horizon=3, action_dim=8)
    spec = xr0.model_spec(config, tensors, action_mask=mask)
    assert spec.heads[0].horizon == 3 and spec.heads[0].action_mask[0] == (1,) * 5 + (0,) * 3
    assert spec.heads[0].kv_layers == (2, 3) and spec.heads[0].num_heads == 2
    with pytest.raises(ValueError, match="horizon 4 disagrees with the action mask's 3 rows"):
        xr0.model_spec(config, tensors, action_mask=mask, horizon=4)
    with pytest.raises(ValueError, match=r"action_mask must be \[Ha, Ad\] of 0 / 1"):
        xr0.model_spec(config, tensors, action_mask=np.full((3, 8), 0.5))
    assert jax.tree.leaves(spec.heads[0].action_mask)  # hashable nested tuples (a static spec field)
