"""Numerical parity with StarVLA's own QwenPI_v3 / QwenGR00T (the `starvla_*_tiny` fixtures).

    python -m eval.parity.starvla FIXTURE_DIR     # `python -m eval.parity FIXTURE_DIR` picks it for such a fixture

FIXTURE_DIR holds a StarVLA checkpoint (`config.yaml`, `model.safetensors` with StarVLA's names,
`vlm_config.json`) and `reference.npz` made by StarVLA's framework classes (starVLA/starVLA @ 0ed0aad,
transformers 4.57.0; see the fixture README). It is restored with `oxygen_jax.ckpts.starvla.load`, which
reads every dimension from the files. Compared, in both layer layouts (stacked for `lax.scan`, unstacked):

* inputs: patchified raw images, image grids, merged vision tokens, DeepStack features, M-RoPE position
  ids and rope deltas;
* the backbone: every `vlm_hidden_states` entry in the transformers 4.57 convention (`models.hidden_states`)
  and the final-normed output, on real tokens;
* the head, through the prefix pass the runtime uses (`mot.prefix_pass`, `heads.prepare`): projected
  contexts (QwenPI_v3), the state token (GR00T), each cross block's K/V on real tokens, then per
  Euler step the time bucket, `dit_temb`, the DiT input tokens, the DiT output, x_t and the velocity,
  and the final actions of `heads.denoise` (the jitted loop);
* training (`forward`): t from the Beta draws, its bucket, x_t, the target and predicted velocity on the
  R-times repeated batch, and the MSE loss.

Floats pass at max |ours - ref| <= atol + rtol * max |ref| with the fixture's suggested atol = rtol = 1e-4
(`meta.json`; float32 on CPU), integers must match exactly. Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity.checks import Checker, Row, report
from oxygen_jax.ckpts import starvla
from oxygen_jax.models import backbone, mot
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models import heads as hd
from oxygen_jax.models.heads import cross, parts

ATOL = 1e-4
PIXEL_ATOL = 1e-6


def _tolerances(fixture: Path):
    """The fixture's `meta.json` `suggested_tolerances` (atol = rtol = 1e-4 in the shared ones): a float
    passes at max|ours - ref| <= atol + rtol * max|ref|; pixels at an absolute 1e-6."""
    import json

    meta = fixture / "meta.json"
    sugg = (json.loads(meta.read_text()).get("suggested_tolerances") or {}) if meta.is_file() else {}
    atol, rtol = float(sugg.get("atol", ATOL)), sugg.get("rtol")
    rtol = None if rtol is None else float(rtol)
    return lambda quantity, family: (PIXEL_ATOL, None) if family == "pixels" else (atol, rtol)


def is_starvla_fixture(path) -> bool:
    """A StarVLA checkpoint directory with a reference.npz."""
    path = Path(path)
    return (path / "reference.npz").is_file() and starvla.is_starvla(path)


def raw_images(ref) -> list[np.ndarray]:
    """The fixture's `image_r{row}_v{view}_uint8` arrays in (row, view) order."""
    keys = [k for k in ref if re.fullmatch(r"image_r\d+_v\d+_uint8", k)]
    return [ref[k] for k in sorted(keys, key=lambda k: [int(x) for x in re.findall(r"\d+", k)])]


def inputs_from_reference(spec: mot.ModelSpec, ref) -> mot.PrefixInputs:
    """`PrefixInputs` of the fixture's stored ids, mask and processor pixels (positions computed by us)."""
    ids, am = ref["input_ids"], ref["attention_mask"].astype(bool)
    vspec = spec.backbone.vision
    grid = qwen3_vl.as_grid(ref["image_grid_thw"])
    positions, nxt = qwen3_vl.mrope_positions(ids, am, grid, image_token_id=spec.image_token_id,
                                              spatial_merge_size=vspec.spatial_merge_size)
    return mot.PrefixInputs(input_ids=jnp.asarray(ids, jnp.int32), input_mask=jnp.asarray(am),
                            positions=jnp.asarray(positions), next_position=jnp.asarray(nxt),
                            pixel_values=jnp.asarray(ref["pixel_values"]), grid=grid)


@jax.jit
def _backbone(spec: mot.ModelSpec, params: mot.ModelParams, inputs: mot.PrefixInputs):
    """ViT stages and every hidden state (the backbone's convention: 4.57 for a StarVLA spec)."""
    bspec, dec = spec.backbone, params.decoder
    enc = qwen3_vl.encode(bspec.vision, params.vision, inputs.pixel_values, inputs.grid)
    x, image_mask = qwen3_vl.embed_multimodal(bspec, dec, inputs.input_ids, enc["tokens"], spec.image_token_id)
    deepstack = qwen3_vl.scatter_deepstack(enc["deepstack"], image_mask) if enc["deepstack"].shape[0] else None
    out = backbone.prefill(bspec, dec, x, inputs.positions, inputs.input_mask, deepstack=deepstack, return_hidden=True)
    return dict(tokens=enc["tokens"], deepstack=enc["deepstack"], hidden_states=out["hidden_states"], normed=out["normed"])


@jax.jit
def _head_prepare(spec: mot.ModelSpec, params: mot.ModelParams, inputs: mot.PrefixInputs, state):
    head = spec.heads[0]
    prefix = mot.prefix_pass(spec, params, inputs)
    hp = params.heads[head.name]
    st = hd.prepare(hp, head, prefix, state)
    return st, cross.projected_context(hp, head, prefix)


@jax.jit
def _step(spec: mot.ModelSpec, params: mot.ModelParams, st, x, t_in):
    head = spec.heads[0]
    return cross.velocity_parts(params.heads[head.name], head, st, x, t_in, all_tokens=True)


@jax.jit
def _denoise(spec: mot.ModelSpec, params: mot.ModelParams, st, noise):
    head = spec.heads[0]
    return hd.denoise(params.heads[head.name], head, st, noise)


def _repeat_state(st: parts.HeadState, r: int) -> parts.HeadState:
    """The HeadState of the batch repeated r times in `Tensor.repeat` order (b0, b1, ..., b0, b1, ...)."""
    tile = lambda a, axis: None if a is None else jnp.concatenate([a] * r, axis=axis)  # noqa: E731
    return dataclasses.replace(st, k=tile(st.k, 1), v=tile(st.v, 1), mask=tile(st.mask, 0), extra=tile(st.extra, 0))


def _train_t(framework: str, beta: np.ndarray, noise_s: float) -> np.ndarray:
    """StarVLA's `sample_time`: (s - Beta sample) / s in float32; GR00T clamps the sample at s first."""
    sample = np.asarray(beta, np.float32)
    if framework == "QwenGR00T":
        sample = np.minimum(sample, np.float32(noise_s))
    return ((np.float32(noise_s) - sample) / np.float32(noise_s)).astype(np.float32)


def check_layout(chk: Checker, ck: starvla.StarVLACheckpoint, ref, params: mot.ModelParams) -> None:
    """Every fixture array for one layer layout of `params` (rows go to `chk`)."""
    spec = ck.spec
    head = spec.heads[0]
    am = ref["attention_mask"].astype(bool)
    inputs = inputs_from_reference(spec, ref)
    vspec = spec.backbone.vision

    images = raw_images(ref)
    if images:
        pv, grids = zip(*(qwen3_vl.patchify(im, vspec) for im in images))
        chk.exact("image_grid_thw (from raw images)", np.asarray(grids), ref["image_grid_thw"])
        chk.close("pixel_values (patchify raw images)", np.concatenate(pv), ref["pixel_values"], "pixels")
    chk.exact("position_ids (M-RoPE, real tokens)", inputs.positions, ref["position_ids"], np.broadcast_to(am, ref["position_ids"].shape))
    # HF's rope_deltas: the next position minus the padded row length (left padding counts).
    chk.exact("rope_deltas", np.asarray(inputs.next_position) - am.shape[1], ref["rope_deltas"].reshape(-1))

    bb_out = _backbone(spec, params, inputs)
    chk.close("vision_tokens", bb_out["tokens"], ref["vision_tokens"])
    chk.close("deepstack_features", bb_out["deepstack"], ref["deepstack_features"])
    hs_ours = np.asarray(bb_out["hidden_states"])
    for i in range(ref["vlm_hidden_states"].shape[0]):
        chk.close(f"vlm_hidden_states[{i}] (transformers 4.57, real tokens)", hs_ours[i], ref["vlm_hidden_states"][i], valid=am)
    chk.close("vlm_final_norm_hidden (real tokens)", bb_out["normed"], ref["vlm_final_norm_hidden"], valid=am)

    state = None
    if head.state_dim:
        state = jnp.asarray(ref["state"].reshape(ref["state"].shape[0], -1))
    st, ctx = _head_prepare(spec, params, inputs, state)
    if "projected_context" in ref:
        chk.close("projected_context (real tokens)", np.moveaxis(np.asarray(ctx), 0, 2), np.moveaxis(ref["projected_context"], 0, 2), valid=am)
    if "state_features" in ref:
        chk.close("state_features", st.extra[:, :1], ref["state_features"])
    chk.exact("encoder_attention_mask", np.asarray(st.mask[:, 0]), ref["encoder_attention_mask"])
    chk.exact("cross_block_index", np.asarray(head.cross_blocks), ref["cross_block_index"])
    for name, ours in (("cross_attn_k", st.k), ("cross_attn_v", st.v)):  # ours [Lc, B, P, N, H]; ref [Lc, B, N, P, H]
        chk.close(f"{name} (real tokens)", np.moveaxis(np.asarray(ours), 0, 2), np.moveaxis(np.swapaxes(ref[name], 2, 3), 0, 2), valid=am)

    s = head.num_steps
    buckets = np.asarray([float(parts.time_input(head, jnp.int32(k))[1]) for k in range(s)])
    chk.exact("timestep_bucket", buckets.astype(np.int32), ref["timestep_bucket"])
    chk.close("t_continuous", [float(parts.time_input(head, jnp.int32(k))[0]) for k in range(s)], ref["t_continuous"])
    x = jnp.asarray(ref["noise"])
    got = {k: [] for k in ("dit_temb", "dit_input_tokens", "dit_output", "x_t", "velocity")}
    for k in range(s):
        out = _step(spec, params, st, x, jnp.float32(buckets[k]))
        got["x_t"].append(np.asarray(x))
        for ours, key in (("temb", "dit_temb"), ("tokens", "dit_input_tokens"), ("dit_output", "dit_output"), ("velocity", "velocity")):
            got[key].append(np.asarray(out[ours]))
        x = x + (1.0 / s) * out["velocity"]
    for key, values in got.items():
        chk.close(f"{key} (every step)", np.stack(values), ref[key])
    chk.close("actions (heads.denoise, jitted loop)", _denoise(spec, params, st, jnp.asarray(ref["noise"])), ref["actions"])

    if "train_loss" in ref:
        _check_training(chk, ck, ref, params, st)


def _check_training(chk: Checker, ck: starvla.StarVLACheckpoint, ref, params, st) -> None:
    spec, head, cfg = ck.spec, ck.spec.heads[0], ck.config
    am_cfg = cfg["framework"]["action_model"]
    r = ref["train_noise"].shape[0] // ref["noise"].shape[0]
    want_r = (cfg.get("trainer") or {}).get("repeated_diffusion_steps") if ck.framework == "QwenPI_v3" else am_cfg.get("repeated_diffusion_steps")
    chk.exact("train repeat R (config.yaml)", np.int32(r), np.int32(want_r))
    t = _train_t(ck.framework, ref["train_beta_sample"], float(am_cfg.get("noise_s", 0.999)))
    chk.close("train_t (sample_time of the Beta draws)", t, ref["train_t"])
    bucket = np.trunc(t * np.float32(head.time_scale)).astype(np.int32)  # torch (t * 1000).long()
    chk.exact("train_t_bucket", bucket, ref["train_t_bucket"])
    actions = np.concatenate([ref["train_actions"][:, -head.horizon:]] * r, axis=0)
    noise = ref["train_noise"]
    tt = t[:, None, None]
    x_t = (1 - tt) * noise + tt * actions
    chk.close("train_x_t", x_t, ref["train_x_t"])
    target = actions - noise
    chk.close("train_target_velocity", target, ref["train_target_velocity"])
    pred = np.asarray(_step(spec, params, _repeat_state(st, r), jnp.asarray(x_t, jnp.float32),
                            jnp.asarray(bucket, jnp.float32))["velocity"])
    chk.close("train_pred_velocity", pred, ref["train_pred_velocity"])
    chk.close("train_loss (MSE)", np.mean((pred.astype(np.float64) - target) ** 2), ref["train_loss"])


def run_fixture(fixture: Path) -> tuple[starvla.StarVLACheckpoint, list[Row]]:
    """Restores the fixture's checkpoint and compares every reference array, stacked and unstacked."""
    fixture = Path(fixture).resolve()
    ck = starvla.load(fixture)
    ref = dict(np.load(fixture / "reference.npz"))
    rows: list[Row] = []
    with jax.default_matmul_precision("float32"):
        for layout, params in (("stacked", ck.params), ("unstacked", mot.for_backend(ck.spec, ck.params, "cpu"))):
            chk = Checker(_tolerances(fixture), layout)
            check_layout(chk, ck, ref, params)
            rows += chk.rows
    return ck, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.parity.starvla",
                                 description="Compare oxygen_jax's StarVLA heads with StarVLA's own reference outputs.")
    ap.add_argument("fixture", type=Path, help="StarVLA fixture: config.yaml, model.safetensors, vlm_config.json, reference.npz")
    args = ap.parse_args(argv)
    if not is_starvla_fixture(args.fixture):
        ap.error(f"{args.fixture}: not a StarVLA fixture (config.yaml with framework.name, model.safetensors with "
                 "qwen_vl_interface.model.* tensors, reference.npz)")
    ck, rows = run_fixture(args.fixture)
    h, b = ck.spec.heads[0], ck.spec.backbone
    print(f"[StarVLA {ck.framework}] {args.fixture}: VLM {b.depth} x {b.width} (hidden states {b.hidden_states}); "
          f"DiT {h.depth} x {h.width} ({h.num_heads} x {h.head_dim}, {h.block_pattern}), Ha {h.horizon} x Ad "
          f"{h.action_dim}, S {h.num_steps}; stored but never run: {', '.join(ck.unused) or 'none'}")
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
