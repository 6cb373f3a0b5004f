"""Flow-matching action heads that read one shared VLM prefix: four kinds, their parameters and presets.

A head is a small transformer (a DiT, or π0.5's action expert) that turns noise into an action chunk in
`num_steps` Euler steps, conditioned on what one backbone prefix pass left behind (`Prefix`). The four
kinds differ only in what they read and how:

| kind           | reads from the prefix                         | per-frame precompute (`prepare`)     | model       |
|----------------|-----------------------------------------------|--------------------------------------|-------------|
| `joint_kv`     | post-RoPE K/V of some backbone layers (XR0:   | slice those layers, RoPE tables of   | XR0         |
|                | last 16 of 36), prefix mask, next position    | the head tokens, masks               |             |
| `cross_hidden` | one hidden state per cross block (HF          | LayerNorm + Linear per layer         | StarVLA     |
|                | `hidden_states` indices)                      | (optional), every cross block's K/V  | QwenPI_v3   |
| `cross_last`   | the last `hidden_states` entry only           | every cross block's K/V              | QwenGR00T   |
| `adarms_joint` | post-RoPE K/V of every backbone layer (layer  | none (the layers' K/V, mask and next | π0.5        |
|                | l reads layer l), prefix mask, next position  | position as they are)                |             |
| `time_mlp_joint` | as adarms_joint, plus a robot state token   | the state token                      | π0          |

Per frame: `state = prepare(head_params, spec, prefix)` once, then
`actions = denoise(head_params, spec, state, noise)`, `flow.integrate` over a static step count that
reads `state` and never recomputes it: the cross-attention K/V of a cross head are computed once
per frame, never per denoise step. Clocks (`flow.integrate`): joint_kv and cross heads derive their
time from the step index; adarms_joint keeps openpi's accumulated float32 clock from t0 = 1.

Each kind has its own spec type (`spec.py` has the base `HeadSpec` and the DiT kinds' `DitSpec`), which
checks its own fields and owns its behaviour (what it reads, its tokens, its clock, its weights); this face
runs the spec's methods: `joint.py` (`JointKvSpec`), `cross.py` (`CrossHiddenSpec`, `CrossLastSpec`),
`adarms.py` (`AdaRmsSpec`: π0.5's action expert; its horizon may be 0, the caller's chunk length),
`parts.py` (pieces the DiT kinds use), `presets.py`. The blocks of each kind are described in its module.

Axes (`oxygen_jax.axes`): B batch, P prefix tokens, T head tokens (extra tokens + Ha actions), S
keys (P + T for joint attention), L layers (Lk prefix layers whose K/V are kept, Lh hidden states
kept, Lc cross blocks, Ls self blocks), Da head width, D VLM width, F head MLP, N heads, K KV heads, H head dim,
Ha horizon, Ad action dim, Ds state dim. New here:
    Dx   width of the context a cross block reads (D, or the per-layer projection width)
    Dt   width of the sinusoidal time features (256)
    Do   width of a DiT's output projection before the action decoder (GR00T; none in QwenPI_v3)
    Fo   hidden width of the state encoder / action decoder MLPs of cross heads
    Ne   extra tokens before the actions (sink, state, future tokens)
"""

from __future__ import annotations

import zlib

import jax

from oxygen_jax.models import backbone as bb
from oxygen_jax.models.heads import adarms, cross, joint, time_mlp
from oxygen_jax.models.heads.adarms import AdaRmsHead, AdaRmsSpec, AdaRmsState
from oxygen_jax.models.heads.time_mlp import TimeMlpHead, TimeMlpSpec, TimeMlpState
from oxygen_jax.models.heads.cross import BlockPair, CrossHead, CrossHiddenSpec, CrossLastSpec, CrossSpec
from oxygen_jax.models.heads.joint import JointHead, JointKvSpec
from oxygen_jax.models.heads.parts import HeadState
from oxygen_jax.models.heads.presets import gr00t, preset, starvla_qwenpi_v3, xr0
from oxygen_jax.models.heads.spec import DitSpec, HeadSpec, Kind
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import param_count

HeadParams = JointHead | CrossHead | AdaRmsHead | TimeMlpHead

__all__ = [
    # specs, one type per kind
    "HeadSpec", "DitSpec", "JointKvSpec", "CrossSpec", "CrossHiddenSpec", "CrossLastSpec", "AdaRmsSpec", "TimeMlpSpec",
    "Kind",
    # weights and per-frame state
    "HeadParams", "JointHead", "CrossHead", "AdaRmsHead", "TimeMlpHead", "BlockPair", "HeadState", "AdaRmsState",
    "TimeMlpState",
    "head_tree", "init_head", "abstract_head", "param_count", "unstack_head", "stack_head",
    # running a head
    "prepare", "velocity", "denoise", "sample",
    # presets and the kinds' modules
    "preset", "xr0", "starvla_qwenpi_v3", "gr00t", "joint", "cross", "adarms", "time_mlp",
]


def _check_params(params: HeadParams) -> None:
    if not isinstance(params, HeadParams):
        raise ValueError(f"expected head weights (JointHead, CrossHead, AdaRmsHead or TimeMlpHead), got {type(params).__name__}")


def head_tree(spec: HeadSpec, draw: bb.Draw) -> HeadParams:
    """The parameters of `spec` with every leaf from `draw` (see `backbone.decoder_tree`): the one
    description of their shapes. Random values are fan-in scaled; norm scales sit around 1."""
    return spec.head_tree(draw)


def init_head(spec: HeadSpec, seed: int = 0, dtype: str = "float32") -> HeadParams:
    """Random weights (tests and benchmarks). Seeded by (seed, name): a head's weights do not
    depend on which other heads share its model."""
    return head_tree(spec, bb.numpy_draws((int(seed) << 32) | zlib.crc32(spec.name.encode()), dtype))


def abstract_head(spec: HeadSpec, dtype: str = "float32") -> HeadParams:
    """`jax.ShapeDtypeStruct` leaves via `jax.eval_shape`: nothing is allocated."""
    return jax.eval_shape(lambda: head_tree(spec, bb.zeros_draws(dtype)))


def unstack_head(params: HeadParams) -> HeadParams:
    """The per-step layer stack as `nn.layers.Unstacked` (the fast form on XLA's CPU backend)."""
    _check_params(params)
    return params.unstack()


def stack_head(params: HeadParams) -> HeadParams:
    """Inverse of `unstack_head`."""
    _check_params(params)
    return params.stack()


def prepare(params: HeadParams, spec: HeadSpec, prefix: Prefix, state: jax.Array | None = None) -> HeadState | AdaRmsState:
    """Once per frame: everything the head's denoise steps read from the prefix.

    Args:
      prefix: the shared prefix pass; must hold this head's reads.
      state: [B, Ds] robot state for heads with a state token (else None).
    Returns:
      `HeadState` (`AdaRmsState` for adarms_joint). For cross heads this is where the per-block cross-attention K/V are computed
      (with QwenPI_v3's per-layer LayerNorm + Linear first), once, for all `num_steps` steps.
    """
    spec.check_params(params)
    return spec.prepare(params, prefix, state)


def velocity(params: HeadParams, spec: HeadSpec, st: HeadState | AdaRmsState, x_t: jax.Array, step: jax.Array) -> jax.Array:
    """The head's output v(x_t, t) float32 [B, Ha, Ad] at Euler step `step` (int32; adarms_joint: the
    float32 time t [B] itself, its clock being accumulated)."""
    return spec.velocity(params, st, x_t, step)


def denoise(params: HeadParams, spec: HeadSpec, st: HeadState | AdaRmsState, noise: jax.Array) -> jax.Array:
    """`spec.num_steps` Euler steps of the head's flow from `noise`, reading `st` only.

    The time comes from the step index (`flow.integrate` without `t0`): t = k / S exactly; an
    adarms_joint head keeps openpi's accumulated float32 clock from t = 1 (`spec.clock_start`).

    Args:
      noise: [B, Ha, Ad] x at the noise end (t = 0 for 0_to_1 heads, t = 1 for 1_to_0).
    Returns:
      actions float32 [B, Ha, Ad] (normalised, in the head's action space).
    """
    spec.check_params(params)
    spec.check_noise(noise, st.mask.shape[0])
    return spec.denoise(params, st, noise)


def sample(params: HeadParams, spec: HeadSpec, prefix: Prefix, noise: jax.Array,
           state: jax.Array | None = None) -> jax.Array:
    """`denoise(prepare(prefix))`: one action chunk [B, Ha, Ad] from a shared prefix."""
    spec.check_noise(noise, prefix.mask.shape[0])
    return denoise(params, spec, prepare(params, spec, prefix, state), noise)
