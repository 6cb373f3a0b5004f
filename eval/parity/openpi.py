"""Numerical parity with openpi's π0.5 and π0 (and OxyGen's text decoding) on a reference fixture.

    python -m eval.parity FIXTURE_DIR           # this comparison for an openpi fixture (see `eval.parity.__main__`)

An openpi FIXTURE_DIR is laid out like the shared `openpi_tiny_pi05` fixture (`tests/helpers.openpi_fixture`):
`params/` (released layout), `train_checkpoint/<step>/params/` (training layout, trailing `value` keys),
`reference.npz` and optionally `reference_text_oxygen.npz`. Every dimension (batch, cameras, horizon, action
dim, prompt length, step counts, decode length, LoRA ranks) is inferred from the checkpoint and the arrays.

A π0 fixture (openpi's `Pi0Config(pi05=False)`, like `openpi_tiny_pi0`) is recognised by its `state_proj` leaf:
its `state` array feeds the state token of every step, and `step1/state_token`, `step1/time_emb_t1`,
`step1/action_tokens_t1` and `state_alt/*` (the same sample with only the state changed) are checked too.

LoRA fixtures (like `openpi_tiny_pi05_lora`) are recognised by `lora_*` leaves in the checkpoint.
The adapters are merged on restore (`ckpts.openpi.load_openpi_params`), with the alpha and rslora
that config.json's "lora" entry (or the README's "expert N LoRA | ... alpha X" rows) gives per
expert, alpha = rank otherwise. On top of the usual quantities they add: the merged weights
against `merged_params.npz`; `merged_*` outputs of openpi's LoRA-free model run with those merged
weights; and `nolora/*` (base weights only, and a check that the LoRA result differs from it).

A training layout stores the frozen VLM leaves as bfloat16, and openpi's arithmetic on them differs from its
arithmetic on the released float32 leaves wherever sqrt(D) is not a bfloat16 number (its embedder scales by
sqrt(D) rounded to the table's dtype: 6.9375 for D = 48, not 6.9282). So each reference is compared with the
restore that reproduces the computation that made it: the `trainlayout/*` references (openpi run on the
training layout as stored) with the default restore (`embed_scale="stored"`, openpi's training-layout
arithmetic), every other reference (openpi run on float32 leaves) with the float32 upcast
(`embed_scale="restored"`). Where sqrt(D) is a bfloat16 number (D = 64) the two restores compute the same.

A quantity passes when max|ours - ref| <= atol + rtol * max|ref| (`eval.parity.checks`). Tolerances come
from config.json `suggested_tolerances_float32_cpu` (float32 on CPU) where it names the quantity, else
from the defaults below (the float32 tolerances the openpi_tiny_pi05 fixture suggests). Integer and boolean
quantities must match exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity.checks import Checker, Row
from oxygen_jax.ckpts.openpi import load_openpi_lora, load_openpi_params
from oxygen_jax.runtime import decode
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.vision import siglip
from oxygen_jax.robots.config import CAMERA_SLOTS
from oxygen_jax.models.pi05.lora import EXPERTS
from oxygen_jax.nn.masks import last_valid_index
from oxygen_jax.models.pi05.observation import Observation
from oxygen_jax.models.pi05.params import from_openpi_dict, to_openpi_dict
from oxygen_jax.nn.layers import dense

# Default (atol, rtol) per family: the openpi_tiny_pi05 README's suggested float32 tolerances.
_TOL = {
    "siglip": (1e-5, 1e-5),
    "prefix_tokens": (1e-5, 1e-5),
    "prefix_out": (5e-4, 1e-4),
    "actions": (2e-4, 1e-4),
    "loss": (5e-4, 2e-4),
    "logits": (5e-4, 0.0),
    "bf16": (0.15, 0.0),
    "weights": (1e-6, 1e-6),  # merged weights: float32 merge vs openpi's float64 one
}


class Tolerances:
    """Per-quantity (atol, rtol): config.json's suggestions where they name the quantity, else `_TOL`.

    config.json maps comma-separated name patterns to text, e.g.
    `"prefix/kv_cache_k|v, prefix/out_final_norm (compare ...)": "atol 0.002, rtol 1e-4"`; `*`
    is a wildcard, `k|v` alternatives, and only the first word of each pattern counts. An entry
    without an atol (e.g. "must DIFFER") sets nothing.
    """

    def __init__(self, suggested: dict[str, str] | None = None):
        self.rules: list[tuple[re.Pattern, float, float]] = []
        for names, text in (suggested or {}).items():
            atol = re.search(r"atol\s+([0-9.]+(?:e[-+]?[0-9]+)?)", str(text))
            if atol is None:
                continue
            rtol = re.search(r"rtol\s+([0-9.]+(?:e[-+]?[0-9]+)?)", str(text))
            for name in names.split(","):
                words = name.strip().split()
                if words:
                    self.rules.append((self._regex(words[0]), float(atol.group(1)), float(rtol.group(1)) if rtol else 0.0))

    @staticmethod
    def _regex(pattern: str) -> re.Pattern:
        parts = []
        for piece in re.split(r"([^/_]*\|[^/_]*)", pattern):  # "kv_cache_k|v" -> "kv_cache_(k|v)"
            if "|" in piece:
                parts.append("(" + "|".join(re.escape(a) for a in piece.split("|")) + ")")
            else:
                parts.append(re.escape(piece).replace(r"\*", ".*"))
        return re.compile("".join(parts))

    def get(self, name: str, family: str) -> tuple[float, float]:
        base = name.split(" (", 1)[0]
        for regex, atol, rtol in self.rules:
            if regex.fullmatch(base):
                return atol, rtol
        return _TOL[family]


def observation_of(ref) -> Observation:
    """The model input a reference holds: its cameras (`image/<slot>` [B, H, W, 3] and `image_mask/<slot>` [B], in
    `CAMERA_SLOTS` order, those present) and `tokenized_prompt` / `tokenized_prompt_mask` [B, T]."""
    cams = [c for c in CAMERA_SLOTS if f"image/{c}" in ref]
    return Observation(
        images=jnp.stack([jnp.asarray(ref[f"image/{c}"], jnp.float32) for c in cams], 1),
        image_masks=jnp.stack([jnp.asarray(ref[f"image_mask/{c}"]) for c in cams], 1),
        tokens=jnp.asarray(ref["tokenized_prompt"], jnp.int32),
        token_mask=jnp.asarray(ref["tokenized_prompt_mask"]),
    )


def check_siglip(chk: Checker, params, ref, obs: Observation, cams) -> None:
    """SigLIP's stem, encoder and head outputs of each camera in `cams` (obs.images' order) that `ref` holds."""
    for i, cam in enumerate(cams):
        if f"siglip/{cam}/tokens" not in ref:
            continue
        st = jax.jit(siglip.encode_stages, static_argnums=2)(params.siglip, obs.images[:, i], params.config.jnp_dtype)
        stem_ref = ref[f"siglip/{cam}/stem"]
        chk.close(f"siglip/{cam}/stem", np.asarray(st["stem"]).reshape(stem_ref.shape), stem_ref, "siglip")
        chk.close(f"siglip/{cam}/encoded", st["encoded"], ref[f"siglip/{cam}/encoded"], "siglip")
        chk.close(f"siglip/{cam}/tokens", st["tokens"], ref[f"siglip/{cam}/tokens"], "siglip")


def _check_model(chk: Checker, params, ref, obs: Observation):
    check_siglip(chk, params, ref, obs, [c for c in CAMERA_SLOTS if f"image/{c}" in ref])

    out = jax.jit(model.prefix_forward)(params, obs)
    valid = np.asarray(ref["prefix/input_mask"])
    if "prefix/tokens" in ref:
        chk.close("prefix/tokens", out["tokens"], ref["prefix/tokens"], "prefix_tokens")
    chk.exact("prefix/input_mask", out["input_mask"], ref["prefix/input_mask"])
    if "prefix/ar_mask" in ref:
        chk.exact("prefix/ar_mask", out["ar"], ref["prefix/ar_mask"])
    chk.exact("prefix/positions", out["positions"], ref["prefix/positions"])
    if "prefix/out_final_norm" in ref:
        normed = model.final_norm(params, out["hidden"])
        chk.close("prefix/out_final_norm (valid rows)", normed, ref["prefix/out_final_norm"], "prefix_out", valid)
    for kv in ("k", "v"):
        if f"prefix/kv_cache_{kv}" in ref:
            chk.close(
                f"prefix/kv_cache_{kv} (valid rows)", np.transpose(np.asarray(out[kv]), (1, 2, 0, 3, 4)),
                np.transpose(ref[f"prefix/kv_cache_{kv}"], (1, 2, 0, 3, 4)), "prefix_out", valid,
            )

    cache = model.prefill(params, obs)
    noise = jnp.asarray(ref["noise"], jnp.float32)
    b, ha = noise.shape[:2]
    state = _state(params, ref)
    extra = 0 if state is None else 1  # π0's state token precedes the actions
    if "step1/velocity_t1" in ref:
        ones = jnp.ones((b,), jnp.float32)
        chk.close("step1/velocity_t1", jax.jit(model.velocity)(params, cache, noise, ones, state), ref["step1/velocity_t1"], "actions")
        suffix_positions = cache.next_position[:, None] + jnp.arange(extra + ha)
        chk.exact("step1/suffix_positions", suffix_positions, ref["step1/suffix_positions"])
        if state is None:
            chk.close("step1/adarms_cond_t1", jax.jit(model.time_condition)(params, ones), ref["step1/adarms_cond_t1"], "actions")
            chk.close("step1/suffix_tokens_t1", dense(params.action_in, noise), ref["step1/suffix_tokens_t1"], "actions")
        else:
            _check_pi0_step1(chk, params, ref, noise, state, ones)
    for key in sorted(k for k in ref if k.startswith("actions/num_steps_")):
        n = int(key.rsplit("_", 1)[1])
        chk.close(key, model.denoise(params, cache, noise, n, state), ref[key], "actions")
    if "state_alt/state" in ref:
        alt = jnp.asarray(ref["state_alt/state"], jnp.float32)
        for key in sorted(k for k in ref if k.startswith("state_alt/actions/num_steps_")):
            n = int(key.rsplit("_", 1)[1])
            chk.close(key, model.denoise(params, cache, noise, n, alt), ref[key], "actions")

    if "loss/actions" in ref:
        actions = jnp.asarray(ref["loss/actions"])
        lnoise, ltime = jnp.asarray(ref["loss/noise"]), jnp.asarray(ref["loss/time"])
        loss = model.compute_loss(params, obs, actions, lnoise, ltime, state)
        chk.close("loss/loss_explicit", loss, ref["loss/loss_explicit"], "loss")
        t = ltime[:, None, None]
        x_t = t * lnoise + (1 - t) * actions
        chk.close("loss/x_t", x_t, ref["loss/x_t"], "loss")
        chk.close("loss/u_t", lnoise - actions, ref["loss/u_t"], "loss")
        chk.close("loss/v_t", jax.jit(model.velocity)(params, cache, x_t, ltime, state), ref["loss/v_t"], "loss")
        chk.exact(
            "loss/positions",
            jnp.concatenate([cache.positions, cache.next_position[:, None] + jnp.arange(extra + ha)], axis=1),
            ref["loss/positions"],
        )
        if "loss/loss" in ref:
            # openpi's rng-driven loss drew exactly the stored noise/time, so it is the same computation.
            chk.close("loss/loss (stored noise/time)", loss, ref["loss/loss"], "loss")


def _state(params, ref):
    """π0's state token input [B, Ad] (the fixture's `state`, already normalised), or None for π0.5."""
    return jnp.asarray(ref["state"], jnp.float32) if params.config.variant == "pi0" else None


def _check_pi0_step1(chk: Checker, params, ref, noise, state, ones):
    """π0's suffix pieces at t = 1: the state token, the sincos time embedding, the action tokens and the mask."""
    from oxygen_jax.models.heads import time_mlp

    chk.close("step1/state_token", dense(params.state_proj, state), ref["step1/state_token"], "actions")
    chk.close("step1/time_emb_t1", model.posemb_sincos(ones, params.config.action_expert.width), ref["step1/time_emb_t1"],
              "actions")
    chk.close("step1/action_tokens_t1", dense(params.action_in, noise), ref["step1/action_tokens_t1"], "actions")
    head = model.head_params(params)
    tokens = jnp.concatenate([dense(params.state_proj, state)[:, None], time_mlp.action_tokens(head, noise, ones)], 1)
    chk.close("step1/suffix_tokens_t1", tokens, ref["step1/suffix_tokens_t1"], "actions")
    if "step1/suffix_attn_mask" in ref:
        b, ha = noise.shape[:2]
        prefix = np.asarray(ref["prefix/input_mask"])
        own = np.asarray(time_mlp.suffix_mask(b, ha))
        mask = np.concatenate([np.broadcast_to(prefix[:, None, :], (b, 1 + ha, prefix.shape[1])), own], axis=-1)
        chk.exact("step1/suffix_attn_mask", mask, ref["step1/suffix_attn_mask"])


def _actions(params, obs: Observation, noise, num_steps: int, state=None):
    """`model.sample_actions`, as the `prefill` and `denoise` programs the other checks compile anyway."""
    return model.denoise(params, model.prefill(params, obs), noise, num_steps, state)


def _check_bf16(chk: Checker, path: Path, ref, obs: Observation, **load_kwargs):
    _, p16 = load_openpi_params(path, dtype="bfloat16", **load_kwargs)
    noise = jnp.asarray(ref["noise"], jnp.float32)
    state = _state(p16, ref)
    if "bf16/actions/num_steps_10" in ref:
        chk.close("bf16/actions/num_steps_10 (smoke)", model.sample_actions(p16, obs, noise, 10, state),
                  ref["bf16/actions/num_steps_10"], "bf16")
    if "bf16/loss/loss" in ref:
        loss = model.compute_loss(p16, obs, jnp.asarray(ref["loss/actions"]), jnp.asarray(ref["loss/noise"]),
                                  jnp.asarray(ref["loss/time"]), state)
        chk.close("bf16/loss/loss (smoke)", loss, ref["bf16/loss/loss"], "bf16")


def lora_settings(fixture: Path) -> dict:
    """`load_openpi_params` keyword arguments for a LoRA fixture: alpha per expert and rslora.

    Read from config.json's "lora" entry (one dict per expert, its key naming the expert, e.g.
    "paligemma_llm (expert 0, ...)" / "action_expert (expert 1, ...)", with "alpha" and "rslora"),
    else from README rows like "| expert 1 LoRA | attn + ffn, rank 8, alpha 8 ... |". An expert
    with no stated alpha gets alpha = rank (openpi's variants).
    """
    alpha: dict[str, float] = {}
    rslora = False
    config_path = fixture / "config.json"
    entries = json.loads(config_path.read_text()).get("lora", {}) if config_path.is_file() else {}
    for key, entry in (entries.items() if isinstance(entries, dict) else ()):
        k = key.lower()
        field = "action_expert" if ("expert 1" in k or "action" in k) else "vlm" if any(
            w in k for w in ("expert 0", "llm", "paligemma", "vlm")) else None
        if field is None or not isinstance(entry, dict):
            continue
        if entry.get("alpha") is not None:
            alpha[field] = float(entry["alpha"])
        rslora = rslora or bool(entry.get("rslora", False))
    readme = fixture / "README.md"
    if not alpha and readme.is_file():
        for expert, value in re.findall(r"expert (\d) LoRA \|[^|\n]*?alpha ([0-9.]+)", readme.read_text()):
            alpha[("vlm", "action_expert")[int(expert)]] = float(value)
    return {"lora_alpha": alpha or None, "lora_rslora": rslora}


def _check_merged_reference(chk: Checker, base, merged_npz, ref, obs: Observation):
    """openpi's LoRA-free model with its own merged weights (`merged_*` references) against ours."""
    flat = {**{k: np.asarray(v) for k, v in to_openpi_dict(base).items()}, **merged_npz}
    params = from_openpi_dict(flat, base.config)
    out = jax.jit(model.prefix_forward)(params, obs)
    valid = np.asarray(ref["prefix/input_mask"])
    for kv in ("k", "v"):
        key = f"merged_prefix/kv_cache_{kv}"
        if key in ref:
            chk.close(f"{key} (valid rows)", np.transpose(np.asarray(out[kv]), (1, 2, 0, 3, 4)),
                      np.transpose(ref[key], (1, 2, 0, 3, 4)), "prefix_out", valid)
    cache = model.prefill(params, obs)
    noise = jnp.asarray(ref["noise"], jnp.float32)
    if "merged_step1/velocity_t1" in ref:
        ones = jnp.ones((noise.shape[0],), jnp.float32)
        chk.close("merged_step1/velocity_t1", jax.jit(model.velocity)(params, cache, noise, ones),
                  ref["merged_step1/velocity_t1"], "actions")
    for key in sorted(k for k in ref if k.startswith("merged_actions/num_steps_")):
        chk.close(key, model.denoise(params, cache, noise, int(key.rsplit("_", 1)[1])), ref[key], "actions")
    if "merged_loss/loss_explicit" in ref:
        loss = model.compute_loss(params, obs, jnp.asarray(ref["loss/actions"]), jnp.asarray(ref["loss/noise"]),
                                  jnp.asarray(ref["loss/time"]))
        chk.close("merged_loss/loss_explicit", loss, ref["merged_loss/loss_explicit"], "loss")


def _check_lora(chk: Checker, path: Path, params, ref, obs: Observation, merged_npz, **load_kwargs):
    """LoRA-specific quantities of one layout (`params` has the adapters merged; `load_kwargs` restore the base)."""
    noise = jnp.asarray(ref["noise"], jnp.float32)
    flat = to_openpi_dict(params)
    for key in sorted(merged_npz):
        chk.close(f"lora/merged_weights/{key}", flat[key], merged_npz[key], "weights")
    actions = _actions(params, obs, noise, 10)
    if "nolora/actions/num_steps_10" in ref:
        _, base = load_openpi_params(path, lora="ignore", **load_kwargs)
        chk.close("nolora/actions/num_steps_10 (base weights only)", _actions(base, obs, noise, 10),
                  ref["nolora/actions/num_steps_10"], "actions", like="actions/num_steps_10")
        # A loader that dropped the adapters would match nolora/ instead: ours must be far closer to
        # the LoRA reference than to the LoRA-free one.
        ours = np.asarray(actions, np.float64)
        err = float(np.max(np.abs(ours - ref["actions/num_steps_10"])))
        effect = float(np.max(np.abs(ours - ref["nolora/actions/num_steps_10"])))
        atol, _ = chk.tolerance("actions/num_steps_10", "actions")
        chk.add("lora changes actions/num_steps_10 (vs nolora/)", effect, 0.0,
                f"> max(atol, 10 * err vs actions/) = {max(atol, 10 * err):.3g}", effect > max(atol, 10 * err))


def _check_trainlayout(chk: Checker, params, ref, obs: Observation):
    """`trainlayout/*`: openpi run on the training layout as stored, against our default (stored) restore."""
    keys = sorted(k for k in ref if k.startswith("trainlayout/"))
    if not keys:
        return
    out = jax.jit(model.prefix_forward)(params, obs)
    valid = np.asarray(ref["prefix/input_mask"])
    ours = {"prefix/tokens": out["tokens"], "prefix/out_final_norm": model.final_norm(params, out["hidden"]),
            "prefix/kv_cache_k": np.transpose(np.asarray(out["k"]), (1, 2, 0, 3, 4)),
            "prefix/kv_cache_v": np.transpose(np.asarray(out["v"]), (1, 2, 0, 3, 4))}
    noise, cache = jnp.asarray(ref["noise"], jnp.float32), None
    for key in keys:
        name = key.removeprefix("trainlayout/")
        if name == "prefix/tokens":
            chk.close(key, ours[name], ref[key], "prefix_tokens", like=name)
        elif name in ours:  # [L, B, P, K, H] caches compared per (row, position), as in `_check_model`
            want = np.transpose(ref[key], (1, 2, 0, 3, 4)) if "kv_cache" in name else ref[key]
            chk.close(f"{key} (valid rows)", ours[name], want, "prefix_out", valid, like=name)
        elif name.startswith("actions/num_steps_"):
            cache = model.prefill(params, obs) if cache is None else cache
            chk.close(key, model.denoise(params, cache, noise, int(name.rsplit("_", 1)[1])), ref[key], "actions", like=name)


def greedy_text(params, obs: Observation, num_tokens: int):
    """Greedy decode of every row without a stop token; returns (tokens [B, n], logits [B, n, V], cache)."""
    cache = model.prefill(params, obs)
    b = obs.batch_size
    pool = decode.init_pool(model.language_model(params), b, cache.length, num_tokens)
    req = decode.make_requests(b, 0, list(range(b)), rows=list(range(b)), budgets=[num_tokens] * b, stop_ids=[-1] * b)
    logits = [model.lm_logits(params, cache.last_hidden)]
    pool, _, _ = decode.admit(model.language_model(params), pool, cache, req)
    for _ in range(num_tokens - 1):
        pool, _, lg = decode.decode_step(model.language_model(params), pool)
        logits.append(lg)
    return np.asarray(pool.tokens), np.stack([np.asarray(x) for x in logits], 1), cache


def _check_text(chk: Checker, params, text, obs: Observation, noise):
    causal = params.with_config(prompt_attention="causal")
    variants = {"maskaware": obs, "oxygen_allcams": dataclasses.replace(obs, image_masks=jnp.ones_like(obs.image_masks))}
    for name, o in variants.items():
        if f"{name}/tokens" not in text:
            continue
        n = text[f"{name}/tokens"].shape[1]
        tokens, logits, cache = greedy_text(causal, o, n)
        chk.exact(f"{name}/tokens", tokens, text[f"{name}/tokens"])
        chk.close(f"{name}/first_step_logits", logits[:, 0], text[f"{name}/first_step_logits"], "logits")
        chk.close(f"{name}/logits", logits, text[f"{name}/logits"], "logits")
        chk.exact(f"{name}/seed_index", last_valid_index(cache.mask), text[f"{name}/seed_index"])
        chk.exact(f"{name}/prefill_len", cache.num_valid, text[f"{name}/prefill_len"])
        decode_positions = cache.next_position[:, None] + jnp.arange(n)
        chk.exact(f"{name}/decode_positions", decode_positions, text[f"{name}/decode_positions"])
        chk.exact(f"{name}/prefix_positions", cache.positions, text[f"{name}/prefix_positions"])
        out = jax.jit(model.prefix_forward)(causal, o)
        normed = model.final_norm(causal, out["hidden"])
        chk.close(f"{name}/prefix_out_final_norm (valid rows)", normed, text[f"{name}/prefix_out_final_norm"], "prefix_out",
                  np.asarray(cache.mask))
    if "oxygen/prefix_ar_mask" in text:
        chk.exact("oxygen/prefix_ar_mask", jax.jit(model.embed_prefix)(causal, obs)[2], text["oxygen/prefix_ar_mask"])
    if "oxygen_actions/num_steps_10" in text:
        # The action expert never reads prompt_attention: only the causal prefix cache differs, so
        # the bidirectional config's (already compiled) denoise runs on it.
        actions = model.denoise(params, model.prefill(causal, obs), jnp.asarray(noise, jnp.float32), 10)
        chk.close("oxygen_actions/num_steps_10 (causal prompt)", actions, text["oxygen_actions/num_steps_10"], "actions")


def checkpoint_layouts(fixture: Path) -> list[tuple[str, Path]]:
    """(layout name, params folder) of each checkpoint a fixture holds: the released params/ and every
    train_checkpoint/<step>/params/; exits naming the fixture when it holds neither."""
    out = []
    if (fixture / "params").is_dir():
        out.append(("released", fixture / "params"))
    train = fixture / "train_checkpoint"
    if train.is_dir():
        for step in sorted(p for p in train.iterdir() if (p / "params").is_dir()):
            out.append((f"training/{step.name}", step / "params"))
    if not out:
        raise SystemExit(f"{fixture}: no params/ or train_checkpoint/<step>/params/ directory found")
    return out


def is_openpi_fixture(fixture: Path) -> bool:
    train = fixture / "train_checkpoint"
    return (fixture / "params").is_dir() or (train.is_dir() and any((p / "params").is_dir() for p in train.iterdir()))


def run_fixture(fixture: Path, layouts: tuple[str, ...] | None = None) -> list[Row]:
    """Every check of an openpi fixture, per checkpoint layout (`layouts`: only those, e.g. ("released",))."""
    fixture = fixture.resolve()
    ref_path = fixture / "reference.npz"
    if not ref_path.is_file():
        raise SystemExit(f"{fixture}: reference.npz not found")
    ref = dict(np.load(ref_path))
    text_path = fixture / "reference_text_oxygen.npz"
    text = dict(np.load(text_path)) if text_path.is_file() else None
    config_path = fixture / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    tol = Tolerances(config.get("suggested_tolerances_float32_cpu"))
    merged_path = fixture / "merged_params.npz"
    merged_npz = dict(np.load(merged_path)) if merged_path.is_file() else {}
    obs = observation_of(ref)
    rows, flat_first = [], None
    settings = lora_settings(fixture)
    for index, (layout, path) in enumerate(checkpoint_layouts(fixture)):
        if layouts is not None and layout not in layouts:
            continue
        adapters = load_openpi_lora(path, alpha=settings["lora_alpha"], rslora=settings["lora_rslora"])
        load_kwargs = settings if adapters is not None else {}  # None: no LoRA leaves in this checkpoint
        cfg, stored = load_openpi_params(path, **load_kwargs)
        # openpi's float32 references were computed from float32 leaves: compare them with the float32 upcast
        # (module docstring); the training layout as stored is compared with `trainlayout/*` below.
        upcast = {} if cfg.embed_scale_dtype is None else {"embed_scale": "restored"}
        params = load_openpi_params(path, **load_kwargs, **upcast)[1] if upcast else stored
        chk = Checker(tol.get, layout)
        flat = {k: np.asarray(v) for k, v in to_openpi_dict(params).items()}
        if flat_first is None:
            flat_first = flat
        else:
            same = flat.keys() == flat_first.keys() and all(np.array_equal(flat[k], flat_first[k]) for k in flat)
            chk.add("params identical to released layout", 0.0 if same else math.inf, 0.0, "exact", same)
        _check_model(chk, params, ref, obs)
        if adapters is not None:
            _check_lora(chk, path, params, ref, obs, merged_npz, **upcast)
        if layout != "released":
            _check_trainlayout(chk, stored, ref, obs)
        if text is not None:
            _check_text(chk, params, text, obs, ref["noise"])
        if any(k.startswith("bf16/") for k in ref):
            _check_bf16(chk, path, ref, obs, **load_kwargs)
        rows += chk.rows
        note = "" if adapters is None else "; LoRA " + ", ".join(
            f"{field} rank {a.attn_rank}/{a.ffn_rank} (attn/ffn) alpha {a.alpha:g}{' rslora' if a.rslora else ''}"
            for field, _ in EXPERTS if (a := getattr(adapters, field)) is not None
        )
        if upcast:
            note += (f"; sqrt({cfg.vlm.width}) rounded to {cfg.embed_scale_dtype} as stored for trainlayout/*, "
                     "to float32 for the float32 references")
        print(f"[{layout}] {path}: vlm {cfg.vlm}, action expert {cfg.action_expert}, siglip {cfg.siglip}, "
              f"vocab {cfg.vocab_size}{note}", file=sys.stderr)
        if adapters is not None and merged_npz and index == 0:  # layout-independent: once
            chk = Checker(tol.get, "merged_params.npz")
            _, base = load_openpi_params(path, lora="ignore", **upcast)
            _check_merged_reference(chk, base, merged_npz, ref, obs)
            rows += chk.rows
    return rows
