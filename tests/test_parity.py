"""Parity with openpi's π0.5 and OxyGen's text decoding on the shared tiny fixture."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval.parity import __main__ as parity_cli
from eval.parity import openpi as openpi_parity
from helpers import openpi_fixture
from oxygen_jax.ckpts.openpi import load_openpi_params
from oxygen_jax.models.pi05 import model


@pytest.fixture(scope="module")
def rows():
    return openpi_parity.run_fixture(openpi_fixture())


def test_every_reference_quantity_matches_in_both_checkpoint_layouts(rows):
    failed = [f"{r.quantity} [{r.layout}] max abs {r.max_abs:.3g}" for r in rows if not r.ok]
    assert not failed, failed
    layouts = {r.layout for r in rows}
    assert layouts == {"released", "training/1"}
    names = {r.quantity for r in rows}
    for required in ("actions/num_steps_10", "prefix/kv_cache_k (valid rows)", "step1/velocity_t1",
                     "loss/loss_explicit", "maskaware/tokens", "oxygen_allcams/first_step_logits",
                     "oxygen_actions/num_steps_10 (causal prompt)"):
        assert required in names


def test_rng_driven_loss_reproduces_openpi_draws():
    fx = openpi_fixture()
    seed = json.loads((fx / "config.json").read_text())["seeds"]["loss_rng_seed"]
    ref = np.load(fx / "reference.npz")
    _, params = load_openpi_params(fx / "params")
    noise, time = model.sample_noise_and_time(jax.random.key(seed), ref["loss/actions"].shape)
    np.testing.assert_allclose(noise, ref["loss/noise"], atol=1e-6)
    np.testing.assert_allclose(time, ref["loss/time"], atol=1e-6)
    obs = openpi_parity.observation_of(ref)
    loss = model.compute_loss_rng(params, jax.random.key(seed), obs, jnp.asarray(ref["loss/actions"]))
    np.testing.assert_allclose(loss, ref["loss/loss"], atol=5e-4)


def test_dropping_the_masked_camera_of_a_fixture_row_reproduces_openpi_actions():
    fx = openpi_fixture()
    ref = np.load(fx / "reference.npz")
    _, params = load_openpi_params(fx / "params")
    obs = openpi_parity.observation_of(ref)
    row = 1  # its left wrist camera is masked in the fixture
    assert not ref["image_mask/left_wrist_0_rgb"][row]
    keep = [0, 2]
    dropped = type(obs)(obs.images[row:row + 1, keep], obs.image_masks[row:row + 1, keep],
                        obs.tokens[row:row + 1], obs.token_mask[row:row + 1])
    actions = model.sample_actions(params, dropped, jnp.asarray(ref["noise"][row:row + 1]), 10)
    np.testing.assert_allclose(actions[0], ref["actions/num_steps_10"][row], atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def lora_rows():
    from helpers import shared_dir

    path = shared_dir() / "fixtures" / "openpi_tiny_pi05_lora"
    if not path.is_dir():
        pytest.skip(f"../shared fixtures not present: {path} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    return openpi_parity.run_fixture(path)


def test_lora_fixture_matches_openpi_in_both_layouts_with_merged_and_base_references(lora_rows):
    failed = [f"{r.quantity} [{r.layout}] max abs {r.max_abs:.3g}" for r in lora_rows if not r.ok]
    assert not failed, failed
    assert {r.layout for r in lora_rows} == {"released", "training/1", "merged_params.npz"}
    names = {(r.quantity, r.layout) for r in lora_rows}
    for layout in ("released", "training/1"):
        for required in ("actions/num_steps_10", "loss/loss_explicit", "step1/velocity_t1", "prefix/kv_cache_k (valid rows)",
                         "nolora/actions/num_steps_10 (base weights only)", "lora changes actions/num_steps_10 (vs nolora/)",
                         "lora/merged_weights/PaliGemma/llm/layers/attn/attn_vec_einsum/w"):
            assert (required, layout) in names
    assert ("trainlayout/actions/num_steps_10", "training/1") in names
    assert ("merged_actions/num_steps_10", "merged_params.npz") in names
    # The fixture's own (looser) kv tolerance is the one applied.
    kv = next(r for r in lora_rows if r.quantity == "prefix/kv_cache_k (valid rows)")
    assert kv.tol == "atol 0.002 rtol 0.0001"


def _unseen_lora_fixture(root, params, adapters, alpha_in_config, training_layout=True):
    """A LoRA fixture unlike the shared one: tiny dims (2 KV heads, 2 cameras, 56 px), ranks 3/5 (attn/ffn)
    and 2, alpha != rank; references from the merged model with the true alpha."""
    from oxygen_jax.models.pi05 import lora as pi05_lora
    from oxygen_jax.models.pi05 import model
    from oxygen_jax.robots.config import CAMERA_SLOTS
    from helpers import make_obs
    from test_lora import _write_lora_checkpoint

    _write_lora_checkpoint(root / "params", params, adapters, training_layout=False)
    if training_layout:
        _write_lora_checkpoint(root / "train_checkpoint" / "1" / "params", params, adapters, training_layout=True)
    obs = make_obs(params.config, batch=2, cameras=2, lengths=[5, 9], image_masks=[[True, False], [True, True]])
    noise = jax.device_put(np.random.default_rng(0).standard_normal((2, 4, 32)).astype(np.float32))
    merged = pi05_lora.merge(params, adapters)
    prefix = jax.jit(model.prefix_forward)(merged, obs)
    ref = {"tokenized_prompt": obs.tokens, "tokenized_prompt_mask": obs.token_mask, "noise": noise,
           "prefix/input_mask": prefix["input_mask"], "prefix/positions": prefix["positions"],
           "prefix/kv_cache_k": prefix["k"], "actions/num_steps_10": openpi_parity._actions(merged, obs, noise, 10),
           "nolora/actions/num_steps_10": openpi_parity._actions(params, obs, noise, 10)}
    for i, cam in enumerate(CAMERA_SLOTS[:2]):
        ref[f"image/{cam}"], ref[f"image_mask/{cam}"] = obs.images[:, i], obs.image_masks[:, i]
    np.savez(root / "reference.npz", **{k: np.asarray(v) for k, v in ref.items()})
    lora_entry = {"paligemma_llm (expert 0)": {"rank": 3, "alpha": alpha_in_config},
                  "action_expert (expert 1)": {"rank": 2, "alpha": 1.0}}
    (root / "config.json").write_text(json.dumps({"lora": lora_entry}))
    return root


def test_parity_runs_on_an_unseen_lora_fixture_reading_alpha_from_config_json(tmp_path, tiny_params):
    from oxygen_jax.models.pi05 import lora as pi05_lora
    from test_lora import _bf16_exact, _random_b

    cfg = tiny_params.config
    base = _bf16_exact(tiny_params)  # frozen leaves of the training layout are bfloat16
    attn = _random_b(pi05_lora.init_bank(cfg, 1, rank=3, targets=("q", "kv", "out"), seed=4), 5).adapter(1)
    ffn = _random_b(pi05_lora.init_bank(cfg, 1, rank=5, targets=("gating", "linear"), seed=6), 7).adapter(1)
    act = _random_b(pi05_lora.init_bank(cfg.action_expert, 1, rank=2, alpha=1.0, seed=8), 9).adapter(1)
    adapters = pi05_lora.ModelLora(vlm=attn.replace(gating=ffn.gating, linear=ffn.linear, alpha=12.0), action_expert=act)
    # (Both layouts of such checkpoints restore identically: test_lora covers it; one layout suffices here.)
    rows = openpi_parity.run_fixture(_unseen_lora_fixture(tmp_path / "right", base, adapters, alpha_in_config=12.0,
                                                   training_layout=False))
    assert all(r.ok for r in rows) and {r.layout for r in rows} == {"released"}
    assert any(r.quantity.startswith("lora changes") for r in rows)
    # Told the wrong alpha (here: the default, alpha = rank), the same run fails.
    rows = openpi_parity.run_fixture(_unseen_lora_fixture(tmp_path / "wrong", base, adapters, alpha_in_config=3.0,
                                                   training_layout=False))
    assert {r.quantity for r in rows if not r.ok} >= {"actions/num_steps_10", "prefix/kv_cache_k (valid rows)"}


def test_lora_settings_come_from_config_json_or_readme(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"lora": {
        "paligemma_llm (expert 0, variant x)": {"rank": 4, "alpha": 12.0, "rslora": True},
        "action_expert (expert 1, variant y)": {"rank": 8, "alpha": 8.0},
    }}))
    assert openpi_parity.lora_settings(tmp_path) == {"lora_alpha": {"vlm": 12.0, "action_expert": 8.0}, "lora_rslora": True}
    (tmp_path / "config.json").unlink()
    (tmp_path / "README.md").write_text("| expert 0 LoRA | attn + ffn, rank 4, alpha 2 (scaling 0.5) |\n")
    assert openpi_parity.lora_settings(tmp_path) == {"lora_alpha": {"vlm": 2.0}, "lora_rslora": False}
    (tmp_path / "README.md").unlink()
    assert openpi_parity.lora_settings(tmp_path) == {"lora_alpha": None, "lora_rslora": False}


def test_tolerances_are_read_per_quantity_from_config_json():
    tol = openpi_parity.Tolerances({"prefix/kv_cache_k|v, prefix/out_final_norm (where valid)": "atol 0.002, rtol 1e-4",
                             "actions/*": "atol 5e-4", "nolora/actions/num_steps_10": "must differ"})
    assert tol.get("prefix/kv_cache_v (valid rows)", "prefix_out") == (0.002, 1e-4)
    assert tol.get("actions/num_steps_3", "actions") == (5e-4, 0.0)
    assert tol.get("nolora/actions/num_steps_10", "actions") == openpi_parity._TOL["actions"]  # no atol given: default
    assert tol.get("oxygen_actions/num_steps_10", "actions") == openpi_parity._TOL["actions"]


def test_manifest_of_full_size_pi05_maps_exactly():
    from helpers import shared_dir

    path = shared_dir() / "fixtures" / "pi05_param_manifest.json"
    if not path.is_file():
        pytest.skip(f"../shared fixtures not present: {path} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    assert parity_cli.main(["--manifest", str(path)]) == 0
    assert parity_cli.main(["--manifest", str(path.with_name("pi05_lora_param_manifest.json"))]) == 0


def test_the_parity_command_picks_the_comparison_by_fixture_kind(tmp_path, monkeypatch, capsys):
    """An HF Qwen3 checkpoint directory (written here, so it is one no test has seen) runs
    `eval.parity.hf`; an openpi layout runs the openpi checks; anything else is refused by name."""
    from eval.parity import hf as parity_hf
    from oxygen_jax.models import backbone as bb
    from oxygen_jax.ckpts import hf as hf_checkpoint
    from oxygen_jax.ckpts.safetensors import write_safetensors

    spec = bb.preset("qwen3_tiny")
    hf = tmp_path / "some_qwen3"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_checkpoint.config_from_spec(spec)))
    write_safetensors(hf / "model.safetensors", hf_checkpoint.to_hf(spec, bb.init_decoder(spec)))
    openpi = tmp_path / "some_pi05"
    (openpi / "train_checkpoint" / "7" / "params").mkdir(parents=True)
    calls = []
    monkeypatch.setattr(parity_hf, "main", lambda argv: calls.append(("hf", argv)) or 0)
    monkeypatch.setattr(openpi_parity, "run_fixture", lambda path: calls.append(("openpi", path)) or [])
    assert parity_cli.main([str(hf)]) == 0 and parity_cli.main([str(openpi)]) == 0
    assert calls == [("hf", [str(hf)]), ("openpi", openpi)]
    (tmp_path / "neither").mkdir()
    with pytest.raises(SystemExit):
        parity_cli.main([str(tmp_path / "neither")])
    assert "neither an openpi fixture" in capsys.readouterr().err
