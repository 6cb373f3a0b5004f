"""Heads on dims the fixtures do not have: every kind, every dimension and block pattern a checkpoint may hold.

* Each head kind is swept over odd and even depths, widths whose square root is not a bfloat16 number
  (40, 48, 72), KV-head ratios 1, 2 and 4 (the heads that attend to the backbone's K/V), state dims,
  horizons and both StarVLA block patterns (all-cross; interleaved, block i self-attending when i is odd,
  odd depths included), in both layer layouts; each fast path (`heads.prepare` / `velocity` / `denoise`)
  matches the plain float64 reading of `tests/reference_mot.py` to 1e-4.
* A StarVLA checkpoint written in StarVLA's own layout (`config.yaml`, `vlm_config.json`,
  `model.safetensors`) with an odd GR00T depth, an interleaved odd-depth QwenPI_v3 and a QwenPI_v3 without
  projections (its DiT as wide as the VLM) loads back to the same spec and bit-identical weights.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import reference_mot as ref
from oxygen_jax.ckpts import hf, starvla
from oxygen_jax.ckpts.safetensors import write_safetensors
from oxygen_jax.models import backbone as bb
from oxygen_jax.models import heads as hd
from oxygen_jax.models import mot
from oxygen_jax.models.backbone import RopeSpec
from oxygen_jax.models.prefix import Prefix

THETA = 10_000.0
TOL = 1e-4

# name -> (spec, prefix dims (backbone layers, KV heads, head dim, width), layer layout)
_DIT = dict(num_steps=2, time_embed_dim=16)
CASES = {
    # XR0 (joint_kv): N heads over the cache's K heads repeated N / K times (ratio 1, 2, 4)
    "joint_w40_d3_ratio1": (hd.JointKvSpec(name="j1", width=40, depth=3, num_heads=5, num_kv_heads=5, head_dim=8, mlp_dim=56,
                                           action_dim=5, horizon=3, time_input="continuous", kv_layers=(1, 2, 3), state_dim=4,
                                           **_DIT), (4, 5, 8, 24), "stacked"),
    "joint_w48_d2_ratio2": (hd.JointKvSpec(name="j2", width=48, depth=2, num_heads=6, num_kv_heads=3, head_dim=8, mlp_dim=40,
                                           action_dim=3, horizon=5, time_input="continuous", kv_layers=(0, 3), **_DIT),
                            (4, 3, 8, 24), "unstacked"),
    "joint_w72_d1_ratio4": (hd.JointKvSpec(name="j4", width=72, depth=1, num_heads=4, num_kv_heads=1, head_dim=18, mlp_dim=64,
                                           action_dim=7, horizon=4, time_input="continuous", kv_layers=(2,), state_dim=6,
                                           sink=False, **_DIT), (3, 1, 18, 24), "stacked"),
    # StarVLA QwenPI_v3 (cross_hidden): per-block hidden states, with or without projections, either pattern
    "hidden_w40_d3_all_cross": (hd.CrossHiddenSpec(name="h1", width=40, depth=3, num_heads=5, head_dim=8, mlp_dim=48, action_dim=5,
                                                   horizon=3, time_input="bucket", hidden_layers=(2, 3, 4), vlm_width=48,
                                                   hidden_proj=24, io_hidden=20, max_positions=6, num_future_tokens=2, **_DIT),
                                (4, 2, 8, 48), "unstacked"),
    "hidden_w48_d5_interleaved": (hd.CrossHiddenSpec(name="h2", width=48, depth=5, num_heads=4, head_dim=12, mlp_dim=64,
                                                     action_dim=6, horizon=4, time_input="bucket", hidden_layers=(1, 3, 5),
                                                     vlm_width=48, block_pattern="cross_self", io_hidden=24, max_positions=4,
                                                     **_DIT), (5, 2, 8, 48), "stacked"),
    # StarVLA QwenGR00T (cross_last): the last hidden state, odd and even depths, either pattern
    "last_w72_d3_interleaved": (hd.CrossLastSpec(name="l1", width=72, depth=3, num_heads=6, head_dim=12, mlp_dim=80, action_dim=6,
                                                 horizon=5, time_input="bucket", hidden_layer=4, vlm_width=40, state_dim=5,
                                                 num_future_tokens=3, dit_output_dim=20, io_hidden=24, max_positions=7, **_DIT),
                                (4, 2, 8, 40), "unstacked"),
    "last_w48_d5_interleaved": (hd.CrossLastSpec(name="l2", width=48, depth=5, num_heads=4, head_dim=12, mlp_dim=64, action_dim=7,
                                                 horizon=4, time_input="bucket", hidden_layer=3, vlm_width=40, state_dim=3,
                                                 num_future_tokens=2, dit_output_dim=16, io_hidden=20, max_positions=4, **_DIT),
                                (3, 2, 8, 40), "stacked"),
    "last_w40_d4_interleaved": (hd.CrossLastSpec(name="l3", width=40, depth=4, num_heads=5, head_dim=8, mlp_dim=48, action_dim=4,
                                                 horizon=6, time_input="bucket", hidden_layer=3, vlm_width=48,
                                                 num_future_tokens=1, dit_output_dim=12, io_hidden=16, max_positions=6, **_DIT),
                                (3, 2, 8, 48), "unstacked"),
    "last_w48_d3_all_cross": (hd.CrossLastSpec(name="l4", width=48, depth=3, num_heads=6, head_dim=8, mlp_dim=40, action_dim=5,
                                               horizon=3, time_input="bucket", hidden_layer=3, vlm_width=40, state_dim=4,
                                               block_pattern="all_cross", dit_output_dim=24, io_hidden=16, max_positions=3, **_DIT),
                              (3, 2, 8, 40), "stacked"),
    # π0.5's action expert (adarms_joint): one layer per backbone layer, KV-head ratio 1, 2, 4, horizon 0 or fixed
    "adarms_w40_d3_ratio1": (hd.AdaRmsSpec(name="a1", width=40, depth=3, num_heads=4, num_kv_heads=4, head_dim=8, mlp_dim=56,
                                           action_dim=5, horizon=0, num_steps=3), (3, 4, 8, 24), "unstacked"),
    "adarms_w48_d2_ratio2": (hd.AdaRmsSpec(name="a2", width=48, depth=2, num_heads=4, num_kv_heads=2, head_dim=12, mlp_dim=40,
                                           action_dim=3, horizon=5, num_steps=2), (2, 2, 12, 24), "stacked"),
    "adarms_w72_d1_ratio4": (hd.AdaRmsSpec(name="a4", width=72, depth=1, num_heads=8, num_kv_heads=2, head_dim=6, mlp_dim=64,
                                           action_dim=7, horizon=4, num_steps=2), (1, 2, 6, 24), "unstacked"),
}


def _prefix(layers: int, kv_heads: int, head_dim: int, width: int, seed: int, b: int = 2, p: int = 6) -> Prefix:
    """Random K/V of every layer and hidden states 0..layers; row 1 has two padded slots (1-D RoPE)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((b, p), bool)
    mask[1, :2] = False
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return Prefix(k=normal(layers, b, p, kv_heads, head_dim), v=normal(layers, b, p, kv_heads, head_dim),
                  hidden=normal(layers + 1, b, p, width), mask=jnp.asarray(mask),
                  positions=jnp.asarray(np.where(mask, np.cumsum(mask, -1) - 1, 0), jnp.int32),
                  next_position=jnp.asarray(mask.sum(-1), jnp.int32), last_hidden=None, kv_layers=tuple(range(layers)),
                  hidden_layers=tuple(range(layers + 1)), rope=RopeSpec(theta=THETA))


@functools.partial(jax.jit, static_argnums=1)
def _run(params, spec, prefix, noise, state, when):
    """(the velocity at Euler step / flow time `when`, the actions): one program per spec."""
    st = hd.prepare(params, spec, prefix, state)
    return hd.velocity(params, spec, st, noise, when), hd.denoise(params, spec, st, noise)


def _inputs(spec, seed: int, b: int = 2):
    rng = np.random.default_rng(seed)
    horizon = spec.horizon or 3  # adarms horizon 0: the caller's chunk length
    noise = rng.standard_normal((b, horizon, spec.action_dim)).astype(np.float32)
    state = rng.standard_normal((b, spec.state_dim)).astype(np.float32) if spec.state_dim else None
    return noise, state


def _close(ours, want, what):
    ours = np.asarray(ours, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(ours, want, rtol=0, atol=TOL * scale, err_msg=what)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_head_kind_matches_its_plain_reading_on_dims_the_fixtures_do_not_have(case):
    spec, (layers, kv_heads, head_dim, width), layout = CASES[case]
    params = hd.init_head(spec, 7)
    run_params = hd.unstack_head(params) if layout == "unstacked" else params
    prefix = _prefix(layers, kv_heads, head_dim, width, seed=len(case))
    noise, state = _inputs(spec, seed=3)
    host = {f: np.asarray(getattr(prefix, f), np.float64) for f in ("k", "v", "hidden", "mask")}
    next_pos = np.asarray(prefix.next_position)

    if isinstance(spec, hd.CrossSpec):
        _, actions = _run(run_params, spec, prefix, jnp.asarray(noise), state, jnp.int32(0))
        _close(actions, ref.cross_actions(params, spec, host["hidden"], host["mask"], noise, state), f"{case}: actions")
        return
    if isinstance(spec, hd.JointKvSpec):
        step = 1
        velocity, actions = _run(run_params, spec, prefix, jnp.asarray(noise), state, jnp.int32(step))
        v = lambda x, k: ref.joint_kv_velocity(params, spec, host["k"], host["v"], host["mask"], next_pos, THETA, x, state, k)  # noqa: E731
        _close(velocity, v(noise, step), f"{case}: velocity at step {step}")
        x = noise.astype(np.float64)
        for k in range(spec.num_steps):  # t = k / S, dt = 1 / S
            x = x + v(x, k) / spec.num_steps
        _close(actions, x, f"{case}: actions")
        return
    t = 0.7
    velocity, actions = _run(run_params, spec, prefix, jnp.asarray(noise), None, jnp.full((noise.shape[0],), t, jnp.float32))
    v = lambda x, t_: ref.adarms_velocity(params, spec, host["k"], host["v"], host["mask"], next_pos, THETA, x, t_)  # noqa: E731
    _close(velocity, v(noise, t), f"{case}: velocity at t = {t}")
    x, clock, dt = noise.astype(np.float64), np.float32(spec.clock_start), np.float32(-1.0 / spec.num_steps)
    for _ in range(spec.num_steps):  # openpi's accumulated float32 clock from t = 1
        x = x + float(dt) * v(x, float(clock))
        clock = np.float32(clock + dt)
    _close(actions, x, f"{case}: actions")


def test_cross_block_patterns_follow_starvla_for_any_depth():
    """StarVLA's DiT: block i self-attends when interleaved and i is odd; 5 blocks: cross 0, 2, 4 and self
    1, 3 (three cross stacks, two self stacks); a head reads one hidden state per cross block."""
    spec = CASES["last_w48_d5_interleaved"][0]
    assert (spec.cross_blocks, spec.num_cross_blocks, spec.num_self_blocks) == ((0, 2, 4), 3, 2)
    assert spec.hidden_layers == (3, 3, 3) and spec.context_layers == (3,)
    params = hd.abstract_head(spec)
    assert params.blocks.cross.kv.kernel.shape == (3, 2, 40, 4, 12) and params.blocks.self_.kv.kernel.shape == (2, 2, 48, 4, 12)
    assert hd.cross.cross_blocks(4, "cross_self") == (0, 2) and hd.cross.cross_blocks(3, "all_cross") == (0, 1, 2)
    even = spec.replace(depth=4)
    assert even.num_self_blocks == even.num_cross_blocks == 2
    layers = hd.unstack_head(hd.init_head(spec))
    assert jax.tree.structure(hd.stack_head(layers)) == jax.tree.structure(hd.init_head(spec))


def test_specs_answer_what_the_runtime_asks_per_kind():
    """The clock and RTC's per-token time are properties of the spec, not a kind string."""
    joint, hidden, adarms = CASES["joint_w40_d3_ratio1"][0], CASES["hidden_w40_d3_all_cross"][0], CASES["adarms_w40_d3_ratio1"][0]
    assert (joint.direction, joint.clock_start, joint.per_token_time) == (1.0, None, False)
    assert (hidden.direction, hidden.per_token_time, hidden.num_kv_heads) == (1.0, False, hidden.num_heads)
    assert (adarms.direction, adarms.clock_start, adarms.per_token_time) == (-1.0, 1.0, True)
    assert adarms.kv_layers == (0, 1, 2) and adarms.extra_tokens == () and adarms.time_embed_dim == 40
    assert joint.replace(t_direction="1_to_0").direction == -1.0
    assert joint.extra_tokens == ("sink", "state") and CASES["joint_w72_d1_ratio4"][0].extra_tokens == ("state",)
    assert CASES["last_w72_d3_interleaved"][0].extra_tokens == ("state", "future") and hidden.extra_tokens == ("future",)
    assert len({joint, hidden, adarms, joint.replace(name="j1")}) == 3  # hashable, equal by value


# --------------------------------------------------------------------------------------------------
# StarVLA's native layout, written from our weights and loaded back


def _t(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32))


def _torch_linear(kernel, bias, name: str) -> dict[str, np.ndarray]:
    """Our kernel [in, out...] -> torch Linear `name.weight` (out, in) and `name.bias` (out,)."""
    k = np.asarray(kernel)
    return {f"{name}.weight": _t(k.reshape(k.shape[0], -1).T), f"{name}.bias": _t(np.asarray(bias).reshape(-1))}


def _native_head(spec: hd.CrossSpec, params: hd.CrossHead, extra_projections: dict[int, int]) -> dict[str, np.ndarray]:
    """StarVLA's tensor names and torch layouts of a cross head (`action_model.*`, `project_layers.*`), written
    from StarVLA's description (diffusers block names, block i in the native order); `extra_projections`:
    block index -> D for project_layers StarVLA stores but never runs (an interleaved QwenPI_v3's self blocks)."""
    am, dit = "action_model.", "action_model.model."
    blocks = params.blocks
    cross_stack, self_stack = (blocks.cross, blocks.self_) if isinstance(blocks, hd.BlockPair) else (blocks, None)
    out, n_cross, n_self = {}, 0, 0
    for i in range(spec.depth):
        if i in spec.cross_blocks:
            blk, n_cross = jax.tree.map(lambda a, j=n_cross: a[j], cross_stack), n_cross + 1
        else:
            blk, n_self = jax.tree.map(lambda a, j=n_self: a[j], self_stack), n_self + 1
        b = f"{dit}transformer_blocks.{i}."
        out |= _torch_linear(blk.ada.kernel, blk.ada.bias, b + "norm1.linear")
        out |= _torch_linear(blk.q.kernel, blk.q.bias, b + "attn1.to_q")
        out |= _torch_linear(blk.kv.kernel[0], blk.kv.bias[0], b + "attn1.to_k")
        out |= _torch_linear(blk.kv.kernel[1], blk.kv.bias[1], b + "attn1.to_v")
        out |= _torch_linear(np.asarray(blk.out.kernel).reshape(-1, spec.width), blk.out.bias, b + "attn1.to_out.0")
        out |= _torch_linear(blk.ff_in.kernel, blk.ff_in.bias, b + "ff.net.0.proj")
        out |= _torch_linear(blk.ff_out.kernel, blk.ff_out.bias, b + "ff.net.2")
    te = dit + "timestep_encoder.timestep_embedder."
    out |= _torch_linear(params.time_mlp.fc1.kernel, params.time_mlp.fc1.bias, te + "linear_1")
    out |= _torch_linear(params.time_mlp.fc2.kernel, params.time_mlp.fc2.bias, te + "linear_2")
    for i, w in enumerate((params.action_in.w1, params.action_in.w2, params.action_in.w3), 1):
        out |= _torch_linear(w.kernel, w.bias, f"{am}action_encoder.layer{i}")
    out |= _torch_linear(params.action_out.fc1.kernel, params.action_out.fc1.bias, am + "action_decoder.layer1")
    out |= _torch_linear(params.action_out.fc2.kernel, params.action_out.fc2.bias, am + "action_decoder.layer2")
    out[am + "position_embedding.weight"] = _t(params.positions)
    out[am + "future_tokens.weight"] = _t(params.future) if params.future is not None else np.zeros((0, spec.width), np.float32)
    if params.state_in is not None:
        out |= _torch_linear(params.state_in.fc1.kernel, params.state_in.fc1.bias, am + "state_encoder.layer1")
        out |= _torch_linear(params.state_in.fc2.kernel, params.state_in.fc2.bias, am + "state_encoder.layer2")
    if params.out_proj is not None:
        out |= _torch_linear(np.asarray(params.out_mod.kernel).reshape(spec.width, -1), params.out_mod.bias, dit + "proj_out_1")
        out |= _torch_linear(params.out_proj.kernel, params.out_proj.bias, dit + "proj_out_2")
    else:  # QwenPI_v3 stores the DiT's output block it never runs (output_dim 26 by default)
        out |= _torch_linear(np.ones((spec.width, 2 * spec.width)), np.zeros(2 * spec.width), dit + "proj_out_1")
        out |= _torch_linear(np.ones((spec.width, 26)), np.zeros(26), dit + "proj_out_2")
    if params.hidden_proj is not None:
        hp = params.hidden_proj
        for c, i in enumerate(spec.cross_blocks):
            out[f"project_layers.{i}.0.weight"], out[f"project_layers.{i}.0.bias"] = _t(hp.norm.scale[c]), _t(hp.norm.bias[c])
            out |= _torch_linear(hp.proj.kernel[c], hp.proj.bias[c], f"project_layers.{i}.1")
    for i, d in extra_projections.items():
        out[f"project_layers.{i}.0.weight"], out[f"project_layers.{i}.0.bias"] = np.ones(d, np.float32), np.zeros(d, np.float32)
        out |= _torch_linear(np.ones((d, spec.context_width)), np.zeros(spec.context_width), f"project_layers.{i}.1")
    return out


def _write_starvla(root, framework: str, spec: hd.CrossSpec, params: hd.CrossHead, backbone: bb.BackboneSpec,
                   dit_cfg: dict, extra_projections: dict[int, int]) -> None:
    model = mot.init_model(mot.ModelSpec(backbone=backbone, heads=(), language=True, image_token_id=500), seed=5)
    tensors = {starvla.VLM + k: v for k, v in hf.to_hf(backbone, model.decoder, model.vision).items()}
    tensors |= _native_head(spec, params, extra_projections)
    write_safetensors(root / "model.safetensors", tensors)
    (root / "vlm_config.json").write_text(json.dumps(hf.config_from_spec(backbone, image_token_id=500)))
    action_model = {
        "action_model_type": "DiT-test" if framework == "QwenGR00T" else "LayerwiseFM", "action_dim": spec.action_dim,
        "action_horizon": spec.horizon, "state_dim": spec.state_dim or 7, "num_inference_timesteps": spec.num_steps,
        "num_timestep_buckets": spec.time_scale, "max_seq_len": spec.max_positions, "add_pos_embed": True,
        "num_target_vision_tokens": spec.num_future_tokens, "hidden_size": spec.io_hidden, "diffusion_model_cfg": dit_cfg,
    }
    (root / "config.yaml").write_text(yaml.safe_dump({"framework": {"name": framework, "action_model": action_model}}))


def _starvla_cases():
    tiny = bb.preset("qwen3vl_tiny")  # 64 wide, 3 layers: what StarVLA's VLM would be
    common = dict(time_input="bucket", num_steps=3, time_embed_dim=16, hidden_states=starvla.HIDDEN_STATES,
                  vlm_width=tiny.width, max_positions=6)
    gr00t = hd.CrossLastSpec(name="gr00t", width=48, depth=5, num_heads=4, head_dim=12, mlp_dim=192, action_dim=6, horizon=5,
                             hidden_layer=tiny.depth, state_dim=5, num_future_tokens=3, dit_output_dim=56, io_hidden=40, **common)
    gr00t_cfg = {"num_layers": 5, "interleave_self_attention": True, "num_attention_heads": 4, "attention_head_dim": 12,
                 "output_dim": 56, "cross_attention_dim": tiny.width, "positional_embeddings": None}
    pi_interleaved = hd.CrossHiddenSpec(name="starvla_qwenpi_v3", width=32, depth=3, num_heads=4, head_dim=8, mlp_dim=128,
                                        action_dim=7, horizon=4, hidden_layers=(1, 3), hidden_proj=32, block_pattern="cross_self",
                                        num_future_tokens=2, io_hidden=24, **common)
    pi_cfg = {"attention_head_dim": 8, "interleave_self_attention": True, "action_dit_hidden_dim": 32}
    pi_identity = hd.CrossHiddenSpec(name="starvla_qwenpi_v3", width=64, depth=2, num_heads=4, head_dim=16, mlp_dim=256,
                                     action_dim=5, horizon=3, hidden_layers=(2, 3), num_future_tokens=1, io_hidden=16, **common)
    identity_cfg = {"attention_head_dim": 16, "action_dit_hidden_dim": None}
    return {"gr00t_depth5": ("QwenGR00T", gr00t, gr00t_cfg, {}),
            "qwenpi_v3_interleaved_depth3": ("QwenPI_v3", pi_interleaved, pi_cfg, {1: tiny.width}),
            "qwenpi_v3_without_projections": ("QwenPI_v3", pi_identity, identity_cfg, {})}


@pytest.mark.parametrize("case", sorted(_starvla_cases()))
def test_a_starvla_checkpoint_of_other_dims_round_trips_through_the_native_layout(case, tmp_path):
    framework, spec, dit_cfg, extra = _starvla_cases()[case]
    params = hd.init_head(spec, 11)
    backbone = bb.preset("qwen3vl_tiny")
    _write_starvla(tmp_path, framework, spec, params, backbone, dit_cfg, extra)
    ck = starvla.load(tmp_path)
    assert ck.framework == framework and ck.spec.heads == (spec,)
    got = ck.params.heads[spec.name]
    assert jax.tree.structure(got) == jax.tree.structure(params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    if framework == "QwenPI_v3":  # stored, never run: the output block, the state encoder, self blocks' projections
        assert any("proj_out_" in u for u in ck.unused)
        assert any(u.startswith("project_layers.1.") for u in ck.unused) == bool(extra)


def test_qwenpi_v3_without_projections_needs_a_dit_as_wide_as_the_vlm(tmp_path):
    framework, spec, dit_cfg, _ = _starvla_cases()["qwenpi_v3_without_projections"]
    narrow = spec.replace(width=32, head_dim=8, mlp_dim=128)
    _write_starvla(tmp_path, framework, narrow, hd.init_head(narrow, 1), bb.preset("qwen3vl_tiny"), dit_cfg | {"attention_head_dim": 8}, {})
    with pytest.raises(ValueError, match=r"no project_layers\.\*, which only a DiT as wide as the VLM \(64\) may omit; this one is 32"):
        starvla.load(tmp_path)
