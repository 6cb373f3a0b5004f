"""LeRobot π0.5 / π0 checkpoint parity: `ckpts.lerobot` + `robots.lerobot` against LeRobot's own outputs.

    python -m eval.parity FIXTURE_DIR      # FIXTURE_DIR holds pretrained_model/, tokenizer/ and reference.npz

The fixture (`lerobot_tiny_pi05`, `lerobot_tiny_pi0`: LeRobot's `save_pretrained` folder and what its code
computed from it) is restored through `ckpts.lerobot.load` and compared quantity by quantity:

* preprocessing (numpy, `robots.lerobot`) from the raw `input/*`: prompts, normalised state and action,
  discretised state (π0.5), tokens and masks, resized images, camera masks, π0's padded state;
* the model on LeRobot's processed inputs with its per-row camera mask (`model/img_masks`): SigLIP output and
  image tokens per camera, prefix embeddings / masks / positions / final-norm output, K and V at valid positions
  (LeRobot's K is [L, B, K, P, H]: transposed to ours), one velocity, the suffix tokens and positions, actions
  after 1 / 3 / 10 Euler steps, the elementwise training loss;
* the policy path: raw inputs -> our preprocessing -> actions cut to the robot's dims (`policy/actions_model`)
  -> LeRobot's un-normaliser (`policy/actions`), and `policy.forward`'s loss (mean, per row, per dim);
* the same with a camera left out of the batch (`policy_missingcam/*`: it goes last, -1, mask False);
* the bfloat16 restore's actions as a loose smoke check (LeRobot keeps SigLIP and the norms in float32).

Tolerances are the fixture README's for float32 on CPU (`_TOL`): actions and velocities 2e-4; prefix
embeddings, V, final-norm outputs 5e-4; K 1e-3 (LeRobot's own spread against openpi's, issue 39); losses 5e-4;
images 1e-5; tokens, masks, positions, discretised state exact. Un-normalised actions get 2e-4 times the
un-normaliser's largest gain (q99 - q01) / 2 or std, printed in the table. SigLIP's head count is not in a
LeRobot checkpoint: it comes from generation_config.json (`spec.vision.num_attention_heads`) when the fixture has one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity.checks import Checker, report
from oxygen_jax.ckpts import lerobot as ckpt_lerobot
from oxygen_jax.models.vision import siglip
from oxygen_jax.models.heads import time_mlp
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.pi05 import model
from oxygen_jax.nn.layers import dense
from oxygen_jax.robots import lerobot as lr
from oxygen_jax.robots.tokenizer import Tokenizer, discretize_state

_TOL = {  # (atol, rtol None = absolute): the fixture README's float32 tolerances
    "processed": (1e-6, None), "images": (1e-5, None), "prefix": (5e-4, None), "k": (1e-3, None),
    "actions": (2e-4, None), "loss": (5e-4, None), "bf16": (0.15, None),
}


def is_lerobot_policy_fixture(path: Path) -> bool:
    """A LeRobot π policy folder (`ckpts.lerobot.is_lerobot_dir`) with `reference.npz` beside it."""
    return (Path(path) / "reference.npz").is_file() and ckpt_lerobot.is_lerobot_dir(path)


def vision_heads_of(fixture: Path) -> int | None:
    """SigLIP's head count of a LeRobot fixture (its generation_config.json's spec.vision), or None."""
    gen = fixture / "generation_config.json"
    if not gen.is_file():
        return None
    return json.loads(gen.read_text()).get("spec", {}).get("vision", {}).get("num_attention_heads")


def _tokenizer(fixture: Path) -> Tokenizer:
    for path in (fixture / "tokenizer" / "tokenizer.model", fixture / "tokenizer.model"):
        if path.is_file():
            return Tokenizer.from_file(path)
    raise SystemExit(f"{fixture}: no tokenizer/tokenizer.model (the tokenizer LeRobot used)")


def _raw_batch(ref, cameras, drop: str | None = None) -> dict:
    batch = {c: ref[f"input/{c}"] for c in cameras if f"input/{c}" in ref and c != drop}
    return {**batch, lr.STATE_KEY: ref[f"input/{lr.STATE_KEY}"], lr.TASK_KEY: [str(t) for t in ref["input/task"]]}


def _check_preprocessing(chk: Checker, io: lr.LeRobotIO, tok: Tokenizer, ref) -> tuple[Observation, np.ndarray | None]:
    batch = _raw_batch(ref, io.cameras)
    state = lr.normalized_state(io, batch)
    chk.close("processed/observation.state", state, ref["processed/observation.state"], "processed")
    chk.close("processed/action", lr.normalize(ref["input/action"], io.normalize[lr.ACTION_KEY]), ref["processed/action"],
              "processed")
    prompts = [io.prompt(t, s) for t, s in zip(batch[lr.TASK_KEY], state)]
    chk.exact("processed/prompt", np.array(prompts), ref["processed/prompt"])
    if "processed/discretized_state" in ref:
        chk.exact("processed/discretized_state", discretize_state(state), ref["processed/discretized_state"])
    obs, padded = lr.make_observation(io, tok, batch)
    chk.exact("processed/tokens", obs.tokens, ref["processed/tokens"])
    chk.exact("processed/attention_mask", obs.token_mask, ref["processed/attention_mask"])
    for i, cam in enumerate(io.cameras):
        if f"processed/images/{cam}" in ref:
            chk.close(f"processed/images/{cam}", obs.images[:, i].transpose(0, 3, 1, 2), ref[f"processed/images/{cam}"],
                      "images")
    chk.exact("processed/img_masks", obs.image_masks.T, ref["processed/img_masks"])
    if "model/state" in ref:
        chk.close("model/state", padded, ref["model/state"], "processed")
    return obs, padded


def _suffix_tokens(params, x_t, t, state):
    """The action expert's input tokens: π0.5 action_in(x_t); π0 [state token ‖ time-mixed action tokens]."""
    if state is None:
        return dense(params.action_in, x_t)
    head = model.head_params(params)
    return jnp.concatenate([dense(head.state_in, state)[:, None], time_mlp.action_tokens(head, x_t, t)], axis=1)


def model_observation(ref, cameras) -> Observation:
    """LeRobot's processed inputs with the per-row camera mask its model-level references used."""
    images = np.stack([ref[f"processed/images/{c}"] for c in cameras], 1).transpose(0, 1, 3, 4, 2)
    return Observation(images=jnp.asarray(images), image_masks=jnp.asarray(ref["model/img_masks"].T),
                       tokens=jnp.asarray(ref["processed/tokens"]), token_mask=jnp.asarray(ref["processed/attention_mask"]))


def _check_model(chk: Checker, params, ref, cameras, state):
    """Every model-level reference, on `model_observation`."""
    obs = model_observation(ref, cameras)
    encode = jax.jit(siglip.encode_stages, static_argnums=2)
    for i, cam in enumerate(cameras):
        st = encode(params.siglip, obs.images[:, i], params.config.jnp_dtype)
        chk.close(f"vision/{cam}/last_hidden_state", st["encoded"], ref[f"vision/{cam}/last_hidden_state"], "prefix")
        chk.close(f"vision/{cam}/tokens", st["tokens"], ref[f"vision/{cam}/tokens"], "prefix")
    out = jax.jit(model.prefix_forward)(params, obs)
    valid = np.asarray(ref["prefix/pad_masks"])
    chk.exact("prefix/pad_masks", out["input_mask"], valid)
    chk.exact("prefix/att_masks", np.broadcast_to(np.asarray(out["ar"]), valid.shape), ref["prefix/att_masks"])
    chk.exact("prefix/position_ids", out["positions"], ref["prefix/position_ids"])
    chk.close("prefix/embs (valid)", out["tokens"], ref["prefix/embs"], "prefix", valid)
    chk.close("prefix/out_final_norm (valid)", model.final_norm(params, out["hidden"]), ref["prefix/out_final_norm"],
              "prefix", valid)
    for kv, family in (("k", "k"), ("v", "prefix")):  # ours [L, B, P, K, H], LeRobot's [L, B, K, P, H]
        ours = np.transpose(np.asarray(out[kv]), (1, 2, 0, 3, 4))
        chk.close(f"prefix/kv_{kv} (valid)", ours, np.transpose(ref[f"prefix/kv_{kv}"], (1, 3, 0, 2, 4)), family, valid)

    cache = model.prefill(params, obs)
    x_t, t = jnp.asarray(ref["step/x_t"]), jnp.asarray(ref["step/time"])
    velocity = jax.jit(model.velocity)
    chk.close("step/velocity", velocity(params, cache, x_t, t, state), ref["step/velocity"], "actions")
    chk.close("step/suffix_embs", _suffix_tokens(params, x_t, t, state), ref["step/suffix_embs"], "actions")
    if "step/adarms_cond" in ref:
        chk.close("step/adarms_cond", model.time_condition(params, t), ref["step/adarms_cond"], "actions")
    n = ref["step/suffix_position_ids"].shape[1]
    chk.exact("step/suffix_position_ids", np.asarray(cache.next_position)[:, None] + np.arange(n),
              ref["step/suffix_position_ids"])
    noise = jnp.asarray(ref["sample/noise"])
    ones = jnp.ones((noise.shape[0],), jnp.float32)
    chk.close("step/velocity_t1_from_noise", velocity(params, cache, noise, ones, state), ref["step/velocity_t1_from_noise"],
              "actions")
    for key in sorted((k for k in ref if k.startswith("sample/actions_num_steps_")), key=lambda k: int(k.rsplit("_", 1)[1])):
        chk.close(key, model.denoise(params, cache, noise, int(key.rsplit("_", 1)[1]), state), ref[key], "actions")
    actions, lnoise, ltime = (jnp.asarray(ref[f"loss/{k}"]) for k in ("actions", "noise", "time"))
    chk.close("loss/losses", _losses(params, cache, actions, lnoise, ltime, state), ref["loss/losses"], "loss")


def _losses(params, cache, actions, noise, time, state) -> np.ndarray:
    """Elementwise flow-matching loss (u_t - v_t)^2 [B, Ha, Ad], x_t = t noise + (1 - t) actions."""
    t = time[:, None, None]
    v = jax.jit(model.velocity)(params, cache, t * noise + (1 - t) * actions, time, state)
    return np.square(np.asarray(noise - actions) - np.asarray(v))


def _gain(norm: lr.FeatureNorm) -> float:
    """The largest factor the un-normaliser multiplies an error by."""
    if norm.mode == "IDENTITY":
        return 1.0
    if norm.mode == "MEAN_STD":
        return float(np.max(np.abs(norm.stats["std"])))
    lo, hi = (norm.stats[k] for k in lr.STATS_OF[norm.mode])
    return float(np.max(np.abs(hi - lo))) / 2


def _check_policy(chk: Checker, ck, tok: Tokenizer, ref, obs: Observation, state, num_steps: int):
    """Raw inputs -> our preprocessing -> the model -> LeRobot's un-normaliser; the policy's training loss."""
    io, params = ck.io, ck.params
    noise = jnp.asarray(ref["policy/noise"])
    cut = np.asarray(model.sample_actions(params, obs, noise, num_steps, state))[..., :io.action_dim]
    chk.close("policy/actions_model", cut, ref["policy/actions_model"], "actions")
    atol = _TOL["actions"][0] * max(1.0, _gain(io.unnormalize[lr.ACTION_KEY]))
    chk.close("policy/actions", lr.robot_actions(io, cut), ref["policy/actions"], (atol, None))
    if "policy/loss" in ref:
        normed = lr.normalize(ref["input/action"], io.normalize[lr.ACTION_KEY])
        padded = np.zeros(normed.shape[:-1] + (io.max_action_dim,), np.float32)
        padded[..., :io.action_dim] = normed
        losses = _losses(params, model.prefill(params, obs), jnp.asarray(padded), jnp.asarray(ref["policy/loss_noise"]),
                         jnp.asarray(ref["policy/loss_time"]), state)[..., :io.action_dim]
        chk.close("policy/loss", losses.mean(), ref["policy/loss"], "loss")
        chk.close("policy/loss_per_sample", losses.mean(axis=(1, 2)), ref["policy/loss_per_sample"], "loss")
        chk.close("policy/loss_per_dim", losses.mean(axis=(0, 1)), ref["policy/loss_per_dim"], "loss")
    if "policy_missingcam/actions" in ref:
        order = [str(c) for c in ref["policy_missingcam/camera_order"]]
        missing = next(c for c in io.cameras if f"input/{c}" in ref and f"policy_missingcam/images/{c}" in ref)
        images, masks, ours_order = lr.camera_images(_raw_batch(ref, io.cameras, drop=missing), io.cameras,
                                                     io.image_resolution)
        chk.exact("policy_missingcam/camera_order", np.array(ours_order), np.array(order))
        chk.exact("policy_missingcam/img_masks", masks.T, ref["policy_missingcam/img_masks"])
        chk.close(f"policy_missingcam/images/{missing}", images[:, ours_order.index(missing)],
                  ref[f"policy_missingcam/images/{missing}"], "images")
        miss_obs, _ = lr.make_observation(io, tok, _raw_batch(ref, io.cameras, drop=missing))
        cut = np.asarray(model.sample_actions(params, miss_obs, noise, num_steps, state))[..., :io.action_dim]
        chk.close("policy_missingcam/actions_model", cut, ref["policy_missingcam/actions_model"], "actions")
        chk.close("policy_missingcam/actions", lr.robot_actions(io, cut), ref["policy_missingcam/actions"], (atol, None))


def run_fixture(fixture: Path) -> list:
    fixture = Path(fixture).resolve()
    ref = dict(np.load(fixture / "reference.npz"))
    heads = vision_heads_of(fixture)
    ck = ckpt_lerobot.load(fixture, "float32", vision_heads=heads)
    tok = _tokenizer(fixture)
    tol = lambda name, family: family if isinstance(family, tuple) else _TOL[family]  # noqa: E731
    chk = Checker(tol)
    obs, state = _check_preprocessing(chk, ck.io, tok, ref)
    model_state = None if state is None else jnp.asarray(ref["model/state"])
    _check_model(chk, ck.params, ref, ck.io.cameras, model_state)
    cfg = json.loads((ck.directory / "config.json").read_text())
    steps = int(cfg.get("num_inference_steps", 10))
    _check_policy(chk, ck, tok, ref, obs, None if state is None else jnp.asarray(state), steps)
    if "bf16/sample/actions_num_steps_10" in ref:
        p16 = ckpt_lerobot.load(fixture, "bfloat16", vision_heads=heads).params
        actions = model.sample_actions(p16, model_observation(ref, ck.io.cameras), jnp.asarray(ref["sample/noise"]), 10,
                                       model_state)
        chk.close("bf16/sample/actions_num_steps_10 (smoke)", actions, ref["bf16/sample/actions_num_steps_10"], "bf16")
    c = ck.config
    print(f"{ck.directory}: LeRobot {ckpt_lerobot.TYPES[c.variant]} ({ck.tensor_names} tensor names), vlm {c.vlm}, "
          f"action expert {c.action_expert}, siglip {c.siglip}, vocab {c.vocab_size}, cameras {list(ck.io.cameras)}",
          file=sys.stderr)
    return chk.rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m eval.parity.lerobot_policy FIXTURE_DIR")
    return report(run_fixture(Path(argv[0])))


if __name__ == "__main__":
    sys.exit(main())
