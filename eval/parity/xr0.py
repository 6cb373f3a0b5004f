"""Numerical parity with the Xiaomi-Robotics-0 fixture made by the native `MiBoTForActionGeneration`.

    python -m eval.parity.xr0 FIXTURE_DIR      # `python -m eval.parity FIXTURE_DIR` picks it for an XR0 directory

FIXTURE_DIR is a released-layout XR0 checkpoint (config.json with model_type 'mibot' + model.safetensors,
`ckpts.xr0`) plus `reference.npz` (../shared/fixtures/xr0_tiny/README.md lists every array). The model
is restored from the files alone; the horizon is the reference action mask's (`action_mask.shape[1]`)
and each row keeps its own mask, as the native call does.

Compared, in both layer layouts (stacked `lax.scan`, and `Unstacked`): patchified pixels, the prefix
M-RoPE ids (real tokens), the K/V the DiT reads and those of every VLM layer (real tokens; pad slots are
masked out of every read and their values are HF's own business), the DiT position ids and attention
mask, the state token, the time modulation per step, every DiT layer's output at step 0, the Euler
trajectory (x fed to each step and the velocity of each step, our own loop from the fixture's noise),
the actions of `heads.denoise` (the runtime's loop), and the training-rule and deploy-rule velocity
and loss. Floats pass at max |ours - ref| <= 1e-4 (pixels 1e-6); ids and masks must match exactly.
Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity.checks import Checker, Row, report
from oxygen_jax.ckpts import xr0 as xr0_ckpt
from oxygen_jax.models import heads as hd
from oxygen_jax.models import mot
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.heads import joint

ATOL = 1e-4
PIXEL_ATOL = 1e-6
TRAIN_OFFSET, TRAIN_WINDOW = 10, 4  # Xiaomi's training rule: +10 on the action positions, band of 4


def _tolerance(quantity: str, family: str | None) -> tuple[float, None]:
    return (PIXEL_ATOL if family == "pixels" else ATOL), None


def is_xr0_fixture(path) -> bool:
    """True for a directory with an XR0 config.json and a reference.npz."""
    return xr0_ckpt.is_xr0_dir(path) and (Path(path) / "reference.npz").is_file()


@functools.partial(jax.jit, static_argnames=("spec",))
def _run(params: mot.ModelParams, spec: mot.ModelSpec, inputs: mot.PrefixInputs, state, action_mask, noise,
         train_x_t, train_t, train_actions, train_noise):
    """Everything the fixture records, from one prefix pass (language=True: every layer's K/V is kept)."""
    h = spec.heads[0]
    hp = params.heads[h.name]
    prefix = mot.prefix_pass(spec, params, inputs)
    k, v = prefix.layer_kv(tuple(range(spec.backbone.depth)))
    st = joint.prepare(hp, h, prefix, state, action_mask)
    out = dict(k_all=k, v_all=v, positions=joint.head_positions(h, prefix), mask=st.mask, state_embed=st.extra[:, 1:2])
    s = h.num_steps
    out["time_mod"] = jnp.stack([joint.time_mod(hp, h, jnp.full((noise.shape[0],), k_ / s * h.time_scale, jnp.float32))
                                 for k_ in range(s)])
    _, out["layers_step0"] = joint.velocity_at(hp, h, st, noise, jnp.zeros((noise.shape[0],)), return_layers=True)
    xs, vs, x = [noise], [], noise
    for k_ in range(s):  # our own Euler loop, step by step (the runtime's loop is `hd.denoise` below)
        vel = joint.velocity(hp, h, st, x, jnp.int32(k_))
        x = x + vel / s
        vs.append(vel), xs.append(x)
    out["x_steps"], out["velocities"] = jnp.stack(xs), jnp.stack(vs)
    out["actions"] = hd.denoise(hp, h, st, noise)
    train = h.replace(action_position_offset=TRAIN_OFFSET, suffix_window=TRAIN_WINDOW)
    st_train = joint.prepare(hp, train, prefix, state, action_mask)
    out["train_positions"], out["train_mask"] = joint.head_positions(train, prefix), st_train.mask
    out["train_velocity"] = joint.velocity_at(hp, train, st_train, train_x_t, train_t)
    out["train_loss"] = joint.loss(hp, train, st_train, train_actions, train_noise, train_t)
    out["train_velocity_deploy"] = joint.velocity_at(hp, h, st, train_x_t, train_t)
    out["train_loss_deploy"] = joint.loss(hp, h, st, train_actions, train_noise, train_t)
    return out


def _raw_images(ref) -> list[np.ndarray]:
    keys = [k for k in ref if re.fullmatch(r"image(\d+)_uint8", k)]
    return [ref[k] for k in sorted(keys, key=lambda k: int(re.findall(r"\d+", k)[0]))]


def fixture_inputs(spec: mot.ModelSpec, ref) -> mot.PrefixInputs:
    """`PrefixInputs` of the fixture's stored token ids, mask and processor pixels (positions by `qwen3_vl`)."""
    ids, am = np.asarray(ref["input_ids"], np.int32), ref["attention_mask"].astype(bool)
    grid = qwen3_vl.as_grid(ref["image_grid_thw"])
    positions, nxt = qwen3_vl.mrope_positions(ids, am, grid, image_token_id=spec.image_token_id,
                                              spatial_merge_size=spec.backbone.vision.spatial_merge_size)
    return mot.PrefixInputs(input_ids=jnp.asarray(ids), input_mask=jnp.asarray(am), positions=jnp.asarray(positions),
                            next_position=jnp.asarray(nxt), pixel_values=jnp.asarray(ref["pixel_values"]), grid=grid)


def run_fixture(fixture: Path) -> tuple[mot.ModelSpec, list[Row]]:
    """Restores the fixture by its own files and compares every reference array (float32 matmuls)."""
    with jax.default_matmul_precision("float32"):
        return _run_fixture(Path(fixture))


def _run_fixture(fixture: Path) -> tuple[mot.ModelSpec, list[Row]]:
    if not (fixture / "reference.npz").is_file():
        raise SystemExit(f"{fixture}: reference.npz not found")
    ref = dict(np.load(fixture / "reference.npz"))
    ck = xr0_ckpt.load(fixture, horizon=int(ref["action_mask"].shape[1]), language=True)
    spec, h = ck.spec, ck.spec.heads[0]
    if "timesteps" in ref and ref["timesteps"].shape[0] != h.num_steps:
        spec = spec.replace(heads=(h.replace(num_steps=int(ref["timesteps"].shape[0])),))
        h = spec.heads[0]
    am = ref["attention_mask"].astype(bool)
    rows: list[Row] = []
    pre = Checker(_tolerance, "-")
    images = _raw_images(ref)
    if images:
        pv, grids = zip(*(qwen3_vl.patchify(im, spec.backbone.vision) for im in images))
        pre.exact("image_grid_thw (from raw images)", np.asarray(grids), ref["image_grid_thw"])
        pre.close("pixel_values (patchify raw images)", np.concatenate(pv), ref["pixel_values"], "pixels")
    inputs = fixture_inputs(spec, ref)
    pre.exact("prefix_position_ids (real tokens)", inputs.positions, ref["prefix_position_ids"],
              np.broadcast_to(am, inputs.positions.shape))
    rows += pre.rows
    args = [jnp.asarray(ref[k]) for k in ("state", "action_mask", "noise", "train_x_t", "train_t", "train_actions",
                                          "train_noise")]
    args[0] = args[0][:, 0]  # state (B, 1, Ds): the one state token
    for layout, backend in (("stacked", "gpu"), ("unstacked", "cpu")):
        chk = Checker(_tolerance, layout)
        out = jax.device_get(_run(mot.for_backend(spec, ck.params, backend), spec, inputs, *args))
        kv_valid = am[:, :, None]  # ours [B, P, L, K, H] after the transpose below; compare real (b, t)
        for name, ours in (("k", out["k_all"]), ("v", out["v_all"])):
            ours = np.transpose(ours, (1, 2, 0, 3, 4))  # [L, B, P, K, H] -> [B, P, L, K, H]
            read = np.asarray(h.kv_layers)
            chk.close(f"{name}_cache (DiT-read layers {h.kv_layers}, real tokens)", ours[:, :, read],
                      np.transpose(ref[f"{name}_cache"], (1, 3, 0, 2, 4)), valid=kv_valid[..., 0])
            chk.close(f"{name}_cache_all_layers (real tokens)", ours,
                      np.transpose(ref[f"{name}_cache_all_layers"], (1, 3, 0, 2, 4)), valid=kv_valid[..., 0])
        chk.exact("dit_position_ids", out["positions"], ref["dit_position_ids"])
        chk.exact("dit_attn_mask", out["mask"], ref["dit_attn_mask"])
        chk.close("state_embed", out["state_embed"], ref["state_embed"])
        chk.close("time_mod (per step)", out["time_mod"], ref["time_mod"])
        chk.close("dit_layer_out_step0", out["layers_step0"], ref["dit_layer_out_step0"])
        chk.close("x_steps (our Euler loop from the fixture noise)", out["x_steps"], ref["x_steps"])
        chk.close("velocities", out["velocities"], ref["velocities"])
        chk.close("actions (heads.denoise)", out["actions"], ref["actions"])
        chk.exact("train_position_ids (+10 on actions)", out["train_positions"], ref["train_position_ids"])
        chk.exact("train_attn_mask (band 4)", out["train_mask"], ref["train_attn_mask"])
        chk.close("train_velocity", out["train_velocity"], ref["train_velocity"])
        chk.close("train_loss", out["train_loss"], ref["train_loss"])
        chk.close("train_velocity_deploy", out["train_velocity_deploy"], ref["train_velocity_deploy"])
        chk.close("train_loss_deploy", out["train_loss_deploy"], ref["train_loss_deploy"])
        rows += chk.rows
    t = ref["train_t"][:, None, None]
    chk = Checker(_tolerance, "-")
    chk.close("train_x_t = (1-t) noise + t actions", (1 - t) * ref["train_noise"] + t * ref["train_actions"], ref["train_x_t"])
    chk.close("train_target = actions - noise", ref["train_actions"] - ref["train_noise"], ref["train_target"])
    chk.close("timesteps = k / S", np.arange(h.num_steps) / h.num_steps, ref["timesteps"])
    return spec, rows + chk.rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.parity.xr0",
                                 description="Compare oxygen_jax's XR0 restore and head with the native MiBoT fixture.")
    ap.add_argument("fixture", type=Path, help="XR0 directory with config.json (model_type 'mibot'), safetensors, reference.npz")
    args = ap.parse_args(argv)
    if not is_xr0_fixture(args.fixture):
        ap.error(f"{args.fixture}: not an XR0 fixture (needs config.json with model_type 'mibot' and reference.npz)")
    spec, rows = run_fixture(args.fixture)
    b, h = spec.backbone, spec.heads[0]
    print(f"[xr0] {args.fixture}: VLM {b.width} x {b.depth} ({b.num_heads}/{b.num_kv_heads} heads x {b.head_dim}), "
          f"ViT {b.vision.depth} x {b.vision.width}; DiT {h.width} x {h.depth} ({h.num_heads} heads, cache KV "
          f"{h.num_kv_heads}), reads layers {h.kv_layers}; state {h.state_dim}, actions {h.horizon} x {h.action_dim}, "
          f"{h.num_steps} steps")
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
