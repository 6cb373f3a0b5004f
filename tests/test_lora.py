"""openpi LoRA: merge maths (checked against openpi's own merge), banks, per-row adapters in the
suffix forward, and restoring LoRA checkpoints in both layouts."""

from __future__ import annotations

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import shared_dir
from oxygen_jax.models import backbone as bb
from oxygen_jax.ckpts.openpi import load_openpi_lora, load_openpi_params
from oxygen_jax.ckpts import openpi_lora
from oxygen_jax.models import lora
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import OPENPI_PATHS, stack_layers, to_openpi_dict, unstack_layers
from oxygen_jax.models.pi05.spec import pi05_spec


def _lora_fixture(*parts: str):
    path = shared_dir() / "fixtures" / "openpi_tiny_pi05_lora"
    if not path.is_dir():
        pytest.skip(f"../shared fixtures not present: {path} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    return path.joinpath(*parts)


def _random_b(bank: lora.LoraBank, seed: int, scale: float = 0.3) -> lora.LoraBank:
    """`bank` with every B factor random (a trained-looking adapter; `init_bank` has B = 0)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put((scale * rng.standard_normal(x.shape)).astype(x.dtype)) if path[-1].name == "b" else x,
        bank,
    )


def _bf16_exact(params):
    """`params` rounded to bfloat16 values, kept float32 (frozen leaves of openpi's training layout)."""
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x).astype(jnp.bfloat16).astype(np.float32)), params)


def _identical(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


# --------------------------------------------------------------------------------------------
# The maths, against openpi's merged weights
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_lora():
    """(config, base params, adapters) of the shared LoRA fixture, released layout."""
    config, base = load_openpi_params(_lora_fixture("params"), lora="ignore", layout="stacked")
    return config, base, load_openpi_lora(_lora_fixture("params"))


def test_merge_reproduces_openpi_merged_weights(fixture_lora):
    config, base, adapters = fixture_lora
    assert (adapters.vlm.attn_rank, adapters.vlm.ffn_rank, adapters.action_expert.attn_rank) == (4, 4, 8)
    assert adapters.vlm.scaling == adapters.action_expert.scaling == 1.0  # alpha defaults to rank
    merged = to_openpi_dict(pi05_lora.merge(base, adapters))
    ref = np.load(_lora_fixture("merged_params.npz"))
    assert len(ref.files) == 10
    for key in ref.files:  # openpi merged in float64: ours (float32) is within an ulp or two
        np.testing.assert_allclose(np.asarray(merged[key]), ref[key], rtol=0, atol=3e-7, err_msg=key)
    for key in set(OPENPI_PATHS) - set(ref.files):
        assert np.array_equal(merged[key], to_openpi_dict(base)[key]), key


def test_openpi_quirks_hold_on_the_fixture(fixture_lora):
    """attn_vec sums B over heads (a per-head merge is wrong); the feed-forward LoRA is unscaled."""
    _, base, adapters = fixture_lora
    ref = np.load(_lora_fixture("merged_params.npz"))
    out = adapters.vlm.out
    w = base.vlm.layers.out
    per_head = w + jnp.einsum("LNHr,LNrD->LNHD", out.a, out.b)
    assert np.max(np.abs(per_head - ref["PaliGemma/llm/layers/attn/attn_vec_einsum/w"])) > 0.1
    # alpha = 2 * rank doubles every attention update and leaves the feed-forward ones alone.
    doubled = pi05_lora.ModelLora(vlm=adapters.vlm.replace(alpha=2.0 * adapters.vlm.attn_rank), action_expert=None)
    once = pi05_lora.ModelLora(vlm=adapters.vlm, action_expert=None)
    d1 = jax.tree.map(jnp.subtract, pi05_lora.merge(base, once).vlm.layers, base.vlm.layers)
    d2 = jax.tree.map(jnp.subtract, pi05_lora.merge(base, doubled).vlm.layers, base.vlm.layers)
    for target in ("q", "kv", "out"):
        np.testing.assert_allclose(getattr(d2, target), 2 * getattr(d1, target), atol=2e-6, err_msg=target)
    for target in ("gating", "linear"):
        assert np.array_equal(getattr(d2, target), getattr(d1, target)), target
    assert np.max(np.abs(d1.gating)) > 0.1  # the unscaled FFN update is there at all


def test_scaling_follows_alpha_over_rank_or_sqrt_rank():
    pair = lora.LoraPair(a=jnp.ones((1, 2, 4, 8)), b=jnp.ones((1, 2, 8, 3)))
    adapter = lora.ExpertLora(q=pair, kv=None, out=None, gating=None, linear=None, alpha=4.0)
    assert adapter.scaling == 0.5
    assert adapter.replace(rslora=True).scaling == pytest.approx(4.0 / np.sqrt(8))
    w = jnp.zeros((1, 2, 4, 3))
    np.testing.assert_array_equal(lora.merge_weight(w, "q", pair, adapter.scaling), np.full((1, 2, 4, 3), 0.5 * 8))


# --------------------------------------------------------------------------------------------
# Banks
# --------------------------------------------------------------------------------------------


def test_init_bank_has_zero_b_random_a_and_the_documented_layout(tiny_params):
    cfg = tiny_params.config.vlm
    bank = pi05_lora.init_bank(tiny_params.config, 3, rank=4, alpha=8.0, seed=0)
    assert bank.num_adapters == 3 and bank.adapters.scaling == 2.0
    chex.assert_shape(bank.adapters.q.a, (cfg.depth, 3, cfg.num_heads, cfg.width, 4))
    chex.assert_shape(bank.adapters.out.b, (cfg.depth, 3, cfg.num_heads, 4, cfg.width))
    chex.assert_shape(bank.adapters.linear.a, (cfg.depth, 3, cfg.mlp_dim, 4))
    assert all(not np.any(p.b) and np.std(np.asarray(p.a)) > 0.01 for p in bank.adapters.pairs().values())
    assert not np.array_equal(bank.adapter(1).q.a, bank.adapter(2).q.a)
    np.testing.assert_array_equal(bank.adapter(3).kv.a, bank.adapters.kv.a[:, 2])
    with pytest.raises(ValueError, match="not stored"):
        bank.adapter(0)
    attn_only = pi05_lora.init_bank(tiny_params.config, 1, rank=2, targets=("q", "kv", "out"))
    assert attn_only.adapters.gating is None and attn_only.adapters.ffn_rank is None


def test_stacking_an_adapter_of_another_rank_lists_every_mismatched_leaf(tiny_params):
    r4 = pi05_lora.init_bank(tiny_params.config, 1, rank=4, alpha=4.0).adapter(1)
    r2 = pi05_lora.init_bank(tiny_params.config, 1, rank=2, alpha=4.0).adapter(1)
    with pytest.raises(ValueError, match="adapter 1 \\(id 2\\)") as e:
        pi05_lora.stack_adapters([r4, r2])
    lines = [line for line in str(e.value).splitlines() if ": expected" in line]
    assert len(lines) == 10  # A and B of all five targets
    assert "q.a: expected (2, 4, 64, 4), got (2, 4, 64, 2)" in str(e.value)
    other = pi05_lora.init_bank(tiny_params.config.action_expert, 1, rank=4).adapter(1)
    with pytest.raises(ValueError, match="does not fit the expert") as e:
        pi05_lora.stack_adapters([other], tiny_params.config)
    assert "linear.b: expected (2, 4, 64), got (2, 4, 32)" in str(e.value)


# --------------------------------------------------------------------------------------------
# Per-row adapters in forward_write
# --------------------------------------------------------------------------------------------


def _write_inputs(cfg, batch=3, steps=2, slots=9, seed=0):
    rng = np.random.default_rng(seed)
    e = cfg.vlm
    x = rng.standard_normal((batch, steps, e.width)).astype(np.float32)
    positions = (rng.integers(0, 20, (batch, 1)) + np.arange(steps)).astype(np.int32)
    write = (rng.integers(0, slots - steps, (batch, 1)) + np.arange(steps)).astype(np.int32)
    mask = (np.arange(slots)[None, None, :] <= write[:, :, None]) | (rng.random((batch, 1, slots)) < 0.5)
    cache = rng.standard_normal((2, e.depth, batch, slots, e.num_kv_heads, e.head_dim)).astype(np.float32)
    return jax.device_put((x, positions, mask, cache[0], cache[1], write))


_CFG = model_config("tiny")  # the config of conftest's `tiny_params`
_jit_write = jax.jit(bb.forward_write)


def _forward_write(layers, *args, lora=None):
    """π0.5's VLM expert stack (`pi05_spec`) writing its K/V; one compiled program per argument structure."""
    return _jit_write(pi05_spec(_CFG), layers, *args, lora=lora)


@pytest.fixture(scope="module")
def bank(tiny_params):
    return _random_b(pi05_lora.init_bank(tiny_params.config, 2, rank=4, alpha=8.0, seed=1), seed=2)  # alpha != rank


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_each_row_runs_its_own_adapter_and_id_0_rows_are_bit_identical(tiny_params, bank, layout):
    layers = tiny_params.vlm.layers if layout == "stacked" else jax.jit(unstack_layers)(tiny_params).vlm.layers
    args = _write_inputs(tiny_params.config)
    ids = jnp.asarray([1, 0, 2], jnp.int32)
    base, base_kv = _forward_write(layers, *args)
    got, got_kv = _forward_write(layers, *args, lora=lora.RowAdapters(bank, ids))
    # id 0: exactly the LoRA-free program's numbers, hidden state and written cache alike.
    assert np.array_equal(got[1], base[1])
    assert all(np.array_equal(g[:, 1], b[:, 1]) for g, b in zip(got_kv, base_kv))
    for row, adapter_id in ((0, 1), (2, 2)):
        merged = lora.merge_layers(layers, bank.adapter(adapter_id))
        ref, ref_kv = _forward_write(merged, *args)
        chex.assert_trees_all_close(got[row], ref[row], atol=5e-5, rtol=1e-5)
        chex.assert_trees_all_close([c[:, row] for c in got_kv], [c[:, row] for c in ref_kv], atol=5e-5, rtol=1e-5)
        assert np.max(np.abs(got[row] - base[row])) > 0.1  # the adapter does something


def test_zero_initialised_adapter_is_bit_identical_to_no_lora(tiny_params):
    zero = pi05_lora.init_bank(tiny_params.config, 2, rank=4, alpha=8.0, seed=3)  # the `bank` program: no new compile
    args = _write_inputs(tiny_params.config, seed=1)
    base, base_kv = _forward_write(tiny_params.vlm.layers, *args)
    rows = lora.RowAdapters(zero, jnp.asarray([1, 2, 1], jnp.int32))
    got, got_kv = _forward_write(tiny_params.vlm.layers, *args, lora=rows)
    assert _identical((got, got_kv), (base, base_kv))
    merged = pi05_lora.merge(tiny_params, pi05_lora.ModelLora(vlm=zero.adapter(1), action_expert=None))
    assert _identical(merged, tiny_params)


def test_only_forward_write_takes_adapters_and_a_misfit_bank_is_refused(tiny_params):
    assert "lora" in inspect.signature(bb.forward_write).parameters
    for fn in (bb.forward_prefill, bb.forward_read, bb.prefill):  # the prefix cache and actions cannot see LoRA
        assert "lora" not in inspect.signature(fn).parameters
    misfit = pi05_lora.init_bank(tiny_params.config.action_expert, 1, rank=2)
    args = _write_inputs(tiny_params.config)
    spec = pi05_spec(tiny_params.config)
    with pytest.raises(ValueError, match="does not fit the expert's layers"):
        bb.forward_write(spec, tiny_params.vlm.layers, *args, lora=lora.RowAdapters(misfit, jnp.zeros((3,), jnp.int32)))
    bank = pi05_lora.init_bank(tiny_params.config, 1, rank=2)
    with pytest.raises(ValueError, match=r"RowAdapters.ids must be \[B\]"):
        bb.forward_write(spec, tiny_params.vlm.layers, *args, lora=lora.RowAdapters(bank, jnp.zeros((2,), jnp.int32)))


# --------------------------------------------------------------------------------------------
# Restoring LoRA checkpoints
# --------------------------------------------------------------------------------------------


def _write_lora_checkpoint(path, params, adapters, *, training_layout: bool):
    """openpi's stored tree; the training layout adds `value` and keeps frozen llm leaves bfloat16."""
    flat = {**to_openpi_dict(params), **openpi_lora.to_openpi(adapters)}
    tree: dict = {}
    for key, leaf in flat.items():
        leaf = np.asarray(leaf)
        if training_layout and key.startswith("PaliGemma/llm/") and not openpi_lora.is_lora_path(key):
            leaf = leaf.astype(jnp.bfloat16)
        node = tree
        parts = key.split("/") + (["value"] if training_layout else [])
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = leaf
    ocp.PyTreeCheckpointer().save(path.resolve(), {"params": tree})
    return path


def test_lora_checkpoint_restore_merges_ignores_or_separates(tmp_path, tiny_params):
    """Ranks differ per expert and between attention and MLP, alpha != rank, one expert without LoRA."""
    base = _bf16_exact(tiny_params)
    attn = _random_b(pi05_lora.init_bank(base.config, 1, rank=3, targets=("q", "kv", "out"), seed=4), 5)
    ffn = _random_b(pi05_lora.init_bank(base.config, 1, rank=5, targets=("gating", "linear"), seed=6), 7)
    vlm = attn.adapter(1).replace(gating=ffn.adapter(1).gating, linear=ffn.adapter(1).linear, alpha=6.0)
    adapters = pi05_lora.ModelLora(vlm=vlm, action_expert=None)
    expected = pi05_lora.merge(base, adapters)
    for training_layout in (False, True):
        path = _write_lora_checkpoint(tmp_path / f"ck{training_layout}" / "params", base, adapters,
                                      training_layout=training_layout)
        config, merged = load_openpi_params(path, lora_alpha={"vlm": 6.0}, layout="stacked")
        # bf16-stored embeddings keep openpi's bf16-rounded sqrt(D) factor (ckpts.openpi docstring).
        assert config == base.config.replace(embed_scale_dtype="bfloat16" if training_layout else None)
        assert _identical(merged, expected)
        # Streamed one layer at a time (the CPU layout), each layer merged on its own: the same bits.
        _, per_layer = load_openpi_params(path, lora_alpha={"vlm": 6.0}, layout="unstacked")
        assert _identical(stack_layers(per_layer), expected)
        restored = load_openpi_lora(path, alpha={"vlm": 6.0})
        assert restored.action_expert is None and (restored.vlm.attn_rank, restored.vlm.ffn_rank) == (3, 5)
        assert _identical(restored, adapters) and restored.vlm.scaling == 2.0
    _, ignored = load_openpi_params(path, lora="ignore", layout="stacked")
    assert _identical(ignored, base)
    # alpha defaults to rank (scaling 1), and is then a different model.
    _, default = load_openpi_params(path, layout="stacked")
    assert not np.array_equal(default.vlm.layers.q, merged.vlm.layers.q)
    assert np.array_equal(default.vlm.layers.gating, merged.vlm.layers.gating)  # FFN: unscaled
    with pytest.raises(ValueError, match="load_openpi_lora"):
        load_openpi_params(path, lora="separate", layout="stacked")
    assert load_openpi_lora(_write_lora_checkpoint(
        tmp_path / "plain" / "params", base, pi05_lora.ModelLora(None, None), training_layout=False)) is None


_LAYOUTS = ["params", "train_checkpoint/1/params"]


def test_lora_fixture_restores_identically_from_both_layouts(fixture_lora):
    config, base, adapters = fixture_lora
    _, merged = load_openpi_params(_lora_fixture("params"), layout="stacked")
    for layout in _LAYOUTS[1:]:
        path = _lora_fixture(*layout.split("/"))
        c2, m2 = load_openpi_params(path, layout="stacked")
        # frozen bf16 leaves upcast exactly; their bf16 embedding keeps openpi's bf16 sqrt(D) factor
        assert c2 == config.replace(embed_scale_dtype="bfloat16") and _identical(m2, merged)
        assert _identical(load_openpi_lora(path), adapters)
        _, b16 = load_openpi_params(path, dtype="bfloat16", layout="stacked")
        assert {x.dtype for x in jax.tree.leaves(b16)} == {jnp.dtype(jnp.bfloat16)}
        assert _identical(b16, jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), merged))
    vlm_bank = pi05_lora.stack_adapters([adapters.vlm], config)  # the serving bank, built from a checkpoint
    assert vlm_bank.num_adapters == 1 and vlm_bank.adapters.q.a.shape == (3, 1, 4, 64, 4)
    assert not _identical(merged, base)
