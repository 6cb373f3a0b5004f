"""openpi's own arithmetic on bfloat16-stored leaves, at widths other than the fixtures' (D = 64).

openpi's Gemma embedder multiplies the table by `sqrt(D)` cast to the table's dtype, and its RMSNorm computes
`normed * (1 + scale)`; both formulas are written out below as the reference and run under `jit` (as openpi
serves and trains). A training-layout checkpoint stores the frozen VLM leaves in bfloat16, so:

* the embedding factor is sqrt(D) rounded to bfloat16 (45.25 for D = 2048, 6.9375 for D = 48, exactly 8 for
  D = 64, which is why the tiny fixtures cannot see it): a float32 restore of such a checkpoint keeps that
  factor (`ModelConfig.embed_scale_dtype`), `embed_scale="restored"` is the documented switch back;
* `1 + scale` with a bfloat16 scale is computed in float32 under jit (XLA drops the bfloat16 round trip), which
  is what `backbone.rms_norm` computes from the upcast scale; op by op it would be rounded (not openpi's path).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from oxygen_jax.ckpts.openpi import load_openpi_params
from oxygen_jax.models import backbone
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.pi05.config import ExpertConfig, model_config
from oxygen_jax.models.pi05.params import init_params, to_openpi_dict
from oxygen_jax.models.pi05.spec import gemma_spec
from oxygen_jax.nn.layers import RMSNorm


def _openpi_embed(table_bf16, tokens):
    """openpi's Embedder.encode on a bfloat16 table, joined with float32 image tokens as its prefix does."""
    x = table_bf16[tokens]
    x = x * jnp.sqrt(x.shape[-1]).astype(x.dtype)
    return jnp.concatenate([jnp.zeros((1, x.shape[-1]), jnp.float32), x.astype(jnp.float32)])[1:]


def _bf16_table(width: int, vocab: int = 16) -> jax.Array:
    rng = np.random.default_rng(width)
    return jnp.asarray(rng.standard_normal((vocab, width)) / math.sqrt(width), jnp.bfloat16)


def _spec(width: int, embed_scale_dtype):
    expert = ExpertConfig(width=width, depth=1, mlp_dim=8, num_heads=1, num_kv_heads=1, head_dim=8)
    return gemma_spec(expert, vocab_size=16, embed_scale_dtype=embed_scale_dtype)


@pytest.mark.parametrize("width", [48, 64, 2048])
def test_the_embedding_factor_of_a_bfloat16_stored_table_matches_openpi_at_any_width(width):
    table = _bf16_table(width)
    tokens = jnp.arange(16) % 16
    want = np.asarray(jax.jit(_openpi_embed)(table, tokens))
    decoder = backbone.Decoder(embedding=table.astype(jnp.float32), layers=None, final_norm=None)  # a float32 restore
    ours = np.asarray(jax.jit(backbone.embed_tokens, static_argnums=0)(_spec(width, "bfloat16"), decoder, tokens))
    np.testing.assert_array_equal(ours, want)
    exact = np.asarray(backbone.embed_tokens(_spec(width, None), decoder, tokens))  # sqrt(D) in float32
    if float(jnp.asarray(math.sqrt(width), jnp.bfloat16)) == math.sqrt(width):  # D = 64: both factors are 8
        np.testing.assert_array_equal(exact, want)
    else:
        assert np.abs(exact - want).max() > 1e-4 * np.abs(want).max()


def test_one_plus_a_bfloat16_scale_is_what_openpi_computes_under_jit():
    rng = np.random.default_rng(0)
    d = 48
    x = jnp.asarray(rng.standard_normal((2, 3, d)), jnp.float32)
    scale = jnp.asarray(0.3 * rng.standard_normal(d), jnp.bfloat16)

    def openpi_norm(x, scale):
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        normed = x * jax.lax.rsqrt(var + 1e-6)
        return (normed * (1 + scale)).astype(x.dtype)

    want = np.asarray(jax.jit(openpi_norm)(x, scale))
    ours = np.asarray(backbone.rms_norm(_spec(d, None), x, RMSNorm(scale=scale.astype(jnp.float32)))[0])
    np.testing.assert_allclose(ours, want, rtol=1e-6, atol=0)  # a few ulps (rsqrt, mean); rounding 1 + s: ~4e-3
    with jax.disable_jit():  # op by op the bfloat16 sum is rounded: a different answer, not openpi's jitted one
        assert np.abs(np.asarray(openpi_norm(x, scale)) - want).max() > 1e-3


def _write_training_layout(path, params):
    """openpi's training layout: leaves under `value`, the frozen PaliGemma/llm leaves (no LoRA here) bfloat16."""
    tree: dict = {}
    for key, leaf in to_openpi_dict(params).items():
        leaf = np.asarray(leaf)
        if key.startswith("PaliGemma/llm/"):
            leaf = leaf.astype(jnp.bfloat16)
        node = tree
        for part in key.split("/"):
            node = node.setdefault(part, {})
        node["value"] = leaf
    ocp.PyTreeCheckpointer().save(path.resolve(), {"params": tree})
    return path


def test_a_training_layout_checkpoint_at_width_48_restores_with_openpis_embedding_factor(tmp_path):
    tiny = model_config("tiny")
    cfg = tiny.replace(vlm=ExpertConfig(width=48, depth=tiny.vlm.depth, mlp_dim=96, num_heads=tiny.vlm.num_heads,
                                        num_kv_heads=tiny.vlm.num_kv_heads, head_dim=tiny.vlm.head_dim))
    path = _write_training_layout(tmp_path / "params", init_params(cfg, 0))
    config, params = load_openpi_params(path)  # float32
    tokens = jnp.arange(12) % cfg.vocab_size
    want = np.asarray(jax.jit(_openpi_embed)(params.embedding.astype(jnp.bfloat16), tokens))
    np.testing.assert_array_equal(np.asarray(model.embed_tokens(params, tokens)), want)
    # the numbers first, then how the config records the switch
    assert (config.dtype, config.embed_scale_dtype, config.vlm.width) == ("float32", "bfloat16", 48)
    switched, p2 = load_openpi_params(path, embed_scale="restored")
    assert switched.embed_scale_dtype is None
    assert np.abs(np.asarray(model.embed_tokens(p2, tokens)) - want).max() > 0
    with pytest.raises(ValueError, match="embed_scale must be 'stored' or 'restored'"):
        load_openpi_params(path, embed_scale="exact")
