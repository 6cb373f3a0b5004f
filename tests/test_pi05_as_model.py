"""π0.5 as one instance of the general model: `pi05.model.as_model` = Gemma + SigLIP backbone + one
`adarms_joint` head, the same arrays as its `Params`, and actions through the general path equal to
π0.5 written out on the backbone primitives (`_reference_actions`), bit for bit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_obs
from oxygen_jax.models import backbone, mot
from oxygen_jax.models.vision import siglip
from oxygen_jax.models import heads as hd
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.pi05.config import EOS_ID
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.pi05.params import abstract_params, init_params, unstack_layers
from oxygen_jax.models.pi05.spec import pi05_spec
from oxygen_jax.nn.layers import dense
from oxygen_jax.nn.masks import make_attn_mask, positions_from_mask
from oxygen_jax.runtime import decode
from oxygen_jax.runtime import frame as schedule
from oxygen_jax.models.vla import MultiHead

STEPS, HA = 3, 5


@pytest.fixture(scope="module")
def tiny():
    cfg = model_config("tiny")
    params = init_params(cfg, 7)
    obs = make_obs(cfg, batch=2, cameras=2, prompt_len=9, image_masks=[[True, False], [True, True]])
    noise = jax.random.normal(jax.random.key(3), (2, HA, cfg.action_dim))
    return dict(cfg=cfg, stacked=params, unstacked=unstack_layers(params), obs=obs, noise=noise)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def _reference_actions(params, obs, noise, num_steps):
    """π0.5 written out on the backbone primitives, with no ModelSpec, head kind or prefix type:
    SigLIP per camera + prompt through the VLM expert, then openpi's Euler loop (float32 time from 1)
    over the action expert attending to the prefix K/V ‖ its own."""
    cfg = params.config
    dt, vspec, aspec = cfg.jnp_dtype, pi05_spec(cfg), pi05_spec(cfg, "action_expert")
    b, c = obs.images.shape[:2]
    img = siglip.encode(params.siglip, obs.images.reshape((b * c,) + obs.images.shape[2:]), dt)
    n_img = img.shape[1]
    txt = backbone.embed_tokens(vspec, model.vlm_decoder(params), obs.tokens).astype(dt)
    x = jnp.concatenate([img.reshape(b, c * n_img, -1), txt], axis=1)
    input_mask = jnp.concatenate([jnp.repeat(obs.image_masks, n_img, axis=1), obs.token_mask], axis=1)
    ar = jnp.zeros(input_mask.shape[1], bool)  # tiny preset: bidirectional prompt
    _, (k, v) = backbone.forward_prefill(vspec, params.vlm.layers, x, positions_from_mask(input_mask),
                                         make_attn_mask(input_mask, ar))
    ha, p = noise.shape[1], input_mask.shape[1]
    positions = jnp.sum(input_mask, -1, dtype=jnp.int32)[:, None] + jnp.arange(ha, dtype=jnp.int32)[None]
    mask = jnp.concatenate([jnp.broadcast_to(input_mask[:, None, :], (b, ha, p)), jnp.ones((b, ha, ha), bool)], -1)
    da = params.time_mlp_in.kernel.shape[0]

    def velocity(x_t, t):
        period = 4e-3 * (4.0 / 4e-3) ** jnp.linspace(0.0, 1.0, da // 2)
        arg = jnp.einsum("i,j->ij", jnp.broadcast_to(t, (b,)), 1.0 / period * 2 * jnp.pi,
                         precision=jax.lax.Precision.HIGHEST)
        emb = jnp.concatenate([jnp.sin(arg), jnp.cos(arg)], -1).astype(dt)
        cond = jax.nn.swish(dense(params.time_mlp_out, jax.nn.swish(dense(params.time_mlp_in, emb))))
        h = backbone.forward_read(aspec, params.action_expert.layers, dense(params.action_in, x_t.astype(dt)),
                                  positions, mask, k, v, cond)
        h, _ = backbone.rms_norm(aspec, h, params.action_expert.final_norm, cond)
        return dense(params.action_out, h).astype(jnp.float32)

    step = -1.0 / num_steps

    def body(_, carry):
        x, t = carry
        return x + step * velocity(x, t), t + step

    return jax.lax.fori_loop(0, num_steps, body, (noise.astype(jnp.float32), jnp.float32(1.0)))[0]


@functools.partial(jax.jit, static_argnums=1)
def _general(model_params, spec, obs, noise):
    return mot.sample_all(model_params, spec, obs, {"actions": noise})["actions"]


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_general_path_actions_bit_identical_to_pi05(tiny, layout):
    params, obs, noise = tiny[layout], tiny["obs"], tiny["noise"]
    spec, weights = model.as_model(params, STEPS)
    general = np.asarray(_general(weights, spec, obs, noise))
    np.testing.assert_array_equal(general, np.asarray(model.sample_actions(params, obs, noise, num_steps=STEPS)))
    np.testing.assert_array_equal(general, np.asarray(_reference_actions(params, obs, noise, STEPS)))
    assert general.shape == noise.shape and np.all(np.isfinite(general)) and np.std(general) > 0


def test_as_model_shares_every_array(tiny):
    params = tiny["unstacked"]
    spec, weights = model.as_model(params)
    same = lambda a, b: len(jax.tree.leaves(a)) == len(jax.tree.leaves(b)) and all(  # noqa: E731
        x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert same(weights.decoder.layers, params.vlm.layers) and weights.decoder.embedding is params.embedding
    assert same(weights.vision, params.siglip)
    head = weights.heads["actions"]
    assert same(head.layers, params.action_expert.layers) and same(head.final_norm, params.action_expert.final_norm)
    assert all(getattr(head, f) is getattr(params, f) for f in ("action_in", "time_mlp_in", "time_mlp_out", "action_out"))
    assert spec.input_kind == "observation" and spec.backbone == pi05_spec(params.config) and spec.names == ("actions",)
    assert spec.reads() == mot.PrefixReads(tuple(range(params.config.vlm.depth)), (), True)


def test_init_model_matches_pi05_parameter_table():
    """`mot.init_model` / `abstract_model` of π0.5's ModelSpec give the tree `as_model` makes of π0.5's own
    parameter table (same structure, shapes, dtypes): SigLIP and the adaRMS head described twice agree."""
    cfg = model_config("tiny")
    spec, want = model.as_model(abstract_params(cfg))
    # By attribute path: π0.5's `ExpertLayers` is `DecoderLayers` without the (None) q/k-norm fields.
    shapes = lambda t: [(jax.tree_util.keystr(k), x.shape, x.dtype)  # noqa: E731
                        for k, x in jax.tree_util.tree_flatten_with_path(t)[0]]
    assert shapes(mot.abstract_model(spec)) == shapes(want)
    drawn = mot.init_model(spec, seed=1)
    assert shapes(drawn) == shapes(want)
    gate = np.asarray(drawn.heads["actions"].final_norm.modulation.bias)[2 * cfg.action_expert.width:]
    assert 0.5 < gate.mean() < 1.5  # adaRMS gates open around 1


def test_pi05_as_vla_is_multihead_of_as_model_and_its_decoder_is_language_model(tiny):
    """π0.5 in the runtime is `MultiHead(as_model(params))` over the same arrays: its frame step's actions are
    π0.5's own, and its language decoder is `language_model(params)` (the same greedy tokens, EOS by default)."""
    params, obs, noise = tiny["unstacked"], tiny["obs"], tiny["noise"]
    vla, general = model.as_vla(params, STEPS), MultiHead(*reversed(model.as_model(params, STEPS)))
    assert isinstance(vla, MultiHead) and vla.spec == general.spec and vla.stop_ids == (EOS_ID,)
    assert vla.params.decoder.embedding is params.embedding  # no copy
    assert vla.action_shape("actions", HA) == (HA, tiny["cfg"].action_dim)
    assert vla.shape_key(obs) == (2, 9) and vla.batch_size(obs) == 2
    noises = {"actions": noise}
    want = np.asarray(model.sample_actions(params, obs, noise, num_steps=STEPS))
    np.testing.assert_array_equal(np.asarray(schedule.head_program(vla, "actions", obs, noises)), want)
    req = decode.make_requests(2, 0, [0, 1], rows=[0, 1], budgets=[4, 4], stop_ids=[-1, -1])
    pool = decode.init_pool(vla.language(), 2, model.prefix_length(params, obs), 4, 0)
    _, out = schedule.frame_step(vla, pool, obs, noises, req, np.zeros(2, bool), tokens_per_frame=3)
    np.testing.assert_array_equal(np.asarray(out.actions["actions"]), want)
    lm = model.language_model(params)
    assert lm.stop_ids == (EOS_ID,)
    alone = decode.init_pool(lm, 2, model.prefix_length(params, obs), 4, 0)
    alone, _, first = decode.admit(lm, alone, model.prefill(params, obs), req)
    alone = decode.decode_to_completion(lm, alone)
    np.testing.assert_array_equal(np.asarray(out.new_tokens)[:, :4], np.asarray(alone.tokens))
    assert np.all(np.asarray(out.new_tokens)[:, :4] >= 0)


def test_adarms_spec_and_inputs_fail_with_one_line_messages(tiny):
    cfg = tiny["cfg"]
    spec = model.model_spec(cfg, STEPS)
    assert model.head_spec(cfg).kv_layers == tuple(range(cfg.action_expert.depth))  # layer l reads layer l, by construction
    with pytest.raises(ValueError, match=r"AdaRmsSpec \(adarms_joint\) has no field 'kv_layers'"):
        model.head_spec(cfg).replace(kv_layers=(0,))
    with pytest.raises(ValueError, match="horizon must be positive"):
        hd.preset("xr0_tiny").replace(horizon=0)
    with pytest.raises(ValueError, match="depth 2 must equal the backbone's 3"):
        mot.ModelSpec(backbone=pi05_spec(cfg).replace(depth=3), heads=spec.heads)
    with pytest.raises(ValueError, match="takes an Observation"):
        mot.check_inputs(spec, mot.PrefixInputs(jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool),
                                                jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32)))
    with pytest.raises(ValueError, match="not mot.make_inputs"):
        mot.make_inputs(spec, np.zeros((1, 4), np.int32), np.ones((1, 4), bool))
    with pytest.raises(ValueError, match="pass horizon >= 1"):
        MultiHead(None, spec).action_shape("actions")
    fixed = model.model_spec(cfg, STEPS, horizon=HA)
    assert MultiHead(None, fixed).action_shape("actions", 99) == (HA, cfg.action_dim)
    spec_h, weights = model.as_model(tiny["unstacked"], STEPS)
    prefix = jax.jit(mot.prefix_pass, static_argnums=0)(spec_h, weights, tiny["obs"])
    with pytest.raises(ValueError, match=r"needs noise \[B, Ha, Ad\] = \(2, Ha >= 1, 32\)"):
        hd.sample(weights.heads["actions"], spec_h.heads[0], prefix, jnp.zeros((2, HA, 7)))
    with pytest.raises(ValueError, match="reads no robot state"):
        hd.prepare(weights.heads["actions"], spec_h.heads[0], prefix, jnp.zeros((2, 8)))
