"""A quantized checkpoint against the native reference: `python -m eval.parity FIXTURE --quantized QDIR`.

    python -m oxygen_jax.quantize --ckpt FIXTURE/params --out QDIR --weights int8   # openpi π0.5 / π0
    python -m oxygen_jax.quantize --ckpt FIXTURE --out QDIR --weights fp8           # a LeRobot π0.5 / π0 policy
    python -m eval.parity FIXTURE --quantized QDIR

QDIR must be what `oxygen_jax.quantize` wrote from one of the fixture's checkpoints (its recorded source
fingerprint is that checkpoint's); anything else is refused in one line (exit status 2). The fixtures are the
ones whose checkpoints the command reads: openpi π0.5 / π0 (with or without LoRA) and LeRobot π0.5 / π0 policies.

Quantized weights cannot reproduce a reference to float32 tolerances, so each output the reference holds is
judged against the quantization bounds the tests hold a quantized model to against float32 (`BOUNDS`,
docs/quantization.md), relative to the reference's scale:

* actions (openpi: every `actions/num_steps_N`, π0's `state_alt/actions/...`, the causal-prompt
  `oxygen_actions/num_steps_N`; LeRobot: `sample/actions_num_steps_N`): max |Δ| / RMS(ref) and mean |Δ| / RMS(ref);
* text (an openpi fixture's `reference_text_oxygen.npz`): the reference's greedy tokens teacher-forced through the
  quantized model (causal prompt, as OxyGen decodes): its greedy choice after the prefix and after each token
  identical to the reference's next token, as a share of every position.

The products run as `run` and `serve` run them (`--quant-matmul`, default auto: `nn.quant.start_matmul`, e.g. int8 x
int8 on a CPU for int8 weights); the dynamic-range modes, which also quantize the activations, are held to the
looser bounds the tests give them (`DYNAMIC_BOUNDS`). Exit status 1 on any FAIL.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eval.parity import openpi
from eval.parity.checks import Checker, Row
from oxygen_jax.ckpts import lerobot as ckpt_lerobot
from oxygen_jax.ckpts.adapters import base_fingerprint
from oxygen_jax.ckpts.orbax_io import CheckpointError
from oxygen_jax.ckpts.own import quantization_info, restore_params, stored_config
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.pi05 import model
from oxygen_jax.nn import quant

# Per weight dtype: actions max and mean |Δ| over the reference's RMS, teacher-forced tokens identical (share);
# weight-only products, and int8 / fp8 products on activations quantized per row.
BOUNDS = {"int8": {"max": 0.25, "mean": 0.03, "tokens": 0.75}, "fp8": {"max": 0.75, "mean": 0.1, "tokens": 0.4}}
DYNAMIC_BOUNDS = {"int8": {"max": 0.3, "mean": 0.05, "tokens": 0.6}, "fp8": {"max": 0.9, "mean": 0.2, "tokens": 0.4}}


class Refused(ValueError):
    """QDIR is no quantized checkpoint of this fixture (one line)."""


def checkpoints_of(fixture: Path) -> list[tuple[str, Path]]:
    """(name, folder) of every checkpoint in `fixture` that `oxygen_jax.quantize` reads."""
    if ckpt_lerobot.is_lerobot_dir(fixture):
        return [("LeRobot policy", fixture)]
    if openpi.is_openpi_fixture(fixture):
        return openpi.checkpoint_layouts(fixture)
    raise Refused(f"{fixture}: --quantized takes an openpi π0.5 / π0 fixture or a LeRobot π0.5 / π0 policy fixture "
                  "(the checkpoints python -m oxygen_jax.quantize reads)")


def source_of(fixture: Path, qdir: Path) -> tuple[str, dict]:
    """(the fixture checkpoint QDIR was quantized from, QDIR's quantization record); `Refused` otherwise."""
    candidates = checkpoints_of(fixture)
    if not qdir.is_dir():
        raise Refused(f"--quantized {qdir}: no such directory")
    try:
        info = quantization_info(qdir)
    except (OSError, ValueError, CheckpointError) as e:
        raise Refused(f"--quantized {qdir}: {str(e).splitlines()[0]}") from None
    if info is None:
        raise Refused(f"--quantized {qdir}: holds no quantized weights; make them with python -m oxygen_jax.quantize "
                      f"--ckpt {candidates[0][1]} --out DIR --weights int8")
    want = info.get("provenance", {}).get("source_fingerprint")
    for name, path in candidates:
        if want is not None and base_fingerprint(path) == want:
            return name, info
    made_from = info.get("provenance", {}).get("source", "an unrecorded source")
    raise Refused(f"--quantized {qdir} was quantized from {made_from}, not from a checkpoint of {fixture} "
                  f"({', '.join(n for n, _ in candidates)}); quantize one of them")


class Bounds:
    """Rows judged by `bound` ({"max", "mean", "tokens"}: one of `BOUNDS` / `DYNAMIC_BOUNDS`)."""

    def __init__(self, bound: dict, layout: str):
        self.bound, self.chk = bound, Checker(lambda *_: (0.0, None), layout)

    def actions(self, name: str, ours, ref) -> None:
        ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
        b = self.bound
        if ours.shape != ref.shape:
            self.chk.add(name, np.inf, np.inf, f"shape {ours.shape} vs {ref.shape}", False)
            return
        diff = np.abs(ours - ref)
        rms = float(np.sqrt(np.mean(ref ** 2))) or 1.0
        worst, mean = float(diff.max()) / rms, float(diff.mean()) / rms
        self.chk.add(f"{name} (max / RMS {worst:.3g}, mean / RMS {mean:.3g})", float(diff.max()),
                     float(diff.max()) / (float(np.abs(ref).max()) or 1.0),
                     f"RMS-relative max <= {b['max']:g}, mean <= {b['mean']:g}",
                     bool(np.isfinite(diff).all() and worst <= b["max"] and mean <= b["mean"]))

    def tokens(self, name: str, ours, ref) -> None:
        ours, ref = np.asarray(ours), np.asarray(ref)
        same = float(np.mean(ours == ref)) if ours.shape == ref.shape else 0.0
        self.chk.add(f"{name} (share identical {same:.3g})", float(np.sum(ours != ref)) if ours.shape == ref.shape
                     else np.inf, 1.0 - same, f"identical >= {self.bound['tokens']:g}", same >= self.bound["tokens"])


def teacher_forced_tokens(params, obs: Observation, tokens) -> np.ndarray:
    """The greedy token after the prefix and after each of `tokens` [B, n] fed in (causal prompt): int [B, n]."""
    causal = params.with_config(prompt_attention="causal")
    cache = model.prefill(causal, obs)
    first = model.lm_logits(causal, cache.last_hidden)[:, None]
    later = _suffix_logits(causal, cache, jnp.asarray(tokens[:, :-1], jnp.int32))
    return np.asarray(jnp.argmax(jnp.concatenate([first, later], 1), -1))


@jax.jit  # the weights are arguments, not constants of the program, and both text variants share it
def _suffix_logits(params, cache, tokens):
    """Logits [B, n, V] after each of `tokens` [B, n] fed causally after every prefix row."""
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    _, _, hidden = model.language_model(params).suffix_forward(cache, rows, tokens)
    return model.lm_logits(params, model.final_norm(params, hidden))


def _openpi_rows(b: Bounds, params, fixture: Path) -> None:
    ref = dict(np.load(fixture / "reference.npz"))
    obs = openpi.observation_of(ref)
    noise = jnp.asarray(ref["noise"], jnp.float32)
    state = jnp.asarray(ref["state"], jnp.float32) if params.config.variant == "pi0" else None
    cache = model.prefill(params, obs)
    for key in sorted(k for k in ref if k.startswith("actions/num_steps_")):
        b.actions(key, model.denoise(params, cache, noise, int(key.rsplit("_", 1)[1]), state), ref[key])
    if "state_alt/state" in ref:
        alt = jnp.asarray(ref["state_alt/state"], jnp.float32)
        for key in sorted(k for k in ref if k.startswith("state_alt/actions/num_steps_")):
            b.actions(key, model.denoise(params, cache, noise, int(key.rsplit("_", 1)[1]), alt), ref[key])
    text_path = fixture / "reference_text_oxygen.npz"
    if not text_path.is_file():
        return
    text = dict(np.load(text_path))
    causal = params.with_config(prompt_attention="causal")
    variants = {"maskaware": obs, "oxygen_allcams": dataclasses.replace(obs, image_masks=jnp.ones_like(obs.image_masks))}
    for name, o in variants.items():
        if f"{name}/tokens" in text:
            b.tokens(f"{name}/tokens (teacher-forced)", teacher_forced_tokens(params, o, text[f"{name}/tokens"]),
                     text[f"{name}/tokens"])
    for key in sorted(k for k in text if k.startswith("oxygen_actions/num_steps_")):
        actions = model.denoise(params, model.prefill(causal, obs), noise, int(key.rsplit("_", 1)[1]), state)
        b.actions(f"{key} (causal prompt)", actions, text[key])


def _lerobot_rows(b: Bounds, params, fixture: Path) -> None:
    from eval.parity.lerobot_policy import model_observation

    ref = dict(np.load(fixture / "reference.npz"))
    obs = model_observation(ref, ckpt_lerobot.read_io(fixture).cameras)
    state = jnp.asarray(ref["model/state"], jnp.float32) if "model/state" in ref else None
    cache, noise = model.prefill(params, obs), jnp.asarray(ref["sample/noise"], jnp.float32)
    for key in sorted((k for k in ref if k.startswith("sample/actions_num_steps_")), key=lambda k: int(k.rsplit("_", 1)[1])):
        b.actions(key, model.denoise(params, cache, noise, int(key.rsplit("_", 1)[1]), state), ref[key])


def run_fixture(fixture: Path, qdir: Path, matmul: str = "auto") -> list[Row]:
    """Every bounded check of QDIR's weights on `fixture` with `matmul` products (see the module docstring);
    `Refused` for a QDIR of another checkpoint or a matmul mode this device or these weights lack."""
    fixture, qdir = Path(fixture).resolve(), Path(qdir).expanduser().resolve()
    name, info = source_of(fixture, qdir)
    try:
        _, params = restore_params(qdir, stored_config(qdir).replace(dtype="float32"))  # float32 activations
    except (OSError, ValueError, CheckpointError) as e:  # a damaged QDIR: one line, as the loaders word it
        raise Refused(f"--quantized {qdir}: {str(e).splitlines()[0]}") from None
    try:
        params, how = quant.start_matmul(params, matmul, jax.devices()[0])
    except ValueError as e:
        raise Refused(str(e)) from None
    weights = info["weights"]
    dynamic = quant.matmul_summary(params).keys() - {"weight_only"}
    b = Bounds((DYNAMIC_BOUNDS if dynamic else BOUNDS)[weights], f"{weights} of {name}, {'/'.join(dynamic) or 'weight-only'} products")
    if ckpt_lerobot.is_lerobot_dir(fixture):
        _lerobot_rows(b, params, fixture)
    else:
        _openpi_rows(b, params, fixture)
    print(f"{qdir}: {how} ({'+'.join(info['provenance'].get('layers', ())) or 'layers unrecorded'}) quantized from "
          f"{name}; bounds {b.bound}", file=sys.stderr)
    return b.chk.rows
