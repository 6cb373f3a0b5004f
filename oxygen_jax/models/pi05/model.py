"""π0.5 as pure functions, and as one instance of the general model (`mot.ModelSpec`).

Axes (`oxygen_jax.axes`): B batch, Nc cameras, Np patches per camera, Tp prompt tokens,
P = Nc*Np + Tp prefix tokens, Ha action horizon, Ad model action dim (32), D VLM width, Da action-expert
width.

π0.5 = a Gemma backbone with SigLIP (`pi05_spec(config)`, the VLM expert with the embedder and the
tied head) + one head of kind `adarms_joint` named "actions" (the action expert, `head_spec`):

    as_model(params) -> (ModelSpec, ModelParams)     the same arrays, no copy
    prefill   = mot.prefix_pass  (models/vision/siglip_prefix.py: SigLIP per camera, prompt, every layer's K/V)
    velocity  = heads.adarms.velocity                (joint K/V read, adaRMS time conditioning)
    denoise   = heads.denoise                        (`flow.integrate`, accumulated float32 clock from t = 1)

Sequence layout and attention (openpi π0.5, with padding cameras dropped rather than masked):

    prefix  [cam_0 Np | cam_1 Np | ... | prompt Tp]   expert 0, bidirectional over valid tokens
            (prompt tokens are causal instead when config.prompt_attention == "causal")
    suffix  [Ha noisy-action tokens]                  expert 1, sees every valid prefix token and
                                                      the whole suffix; prefix never sees suffix
    positions: prefix cumsum(mask) - 1; suffix next_position (= num_valid) + [0, Ha)

Flow matching: t = 1 is noise, t = 0 is data; `denoise` runs `num_steps` Euler steps with
dt = -1/num_steps on a read-only prefix cache. The functions below are the general path's, called
with π0.5's parameters: every output is bit-identical to π0.5 computed on its own (tested).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone, mot
from oxygen_jax.models.vision import siglip_prefix
from oxygen_jax.models import heads as hd
from oxygen_jax.models.backbone import Decoder
from oxygen_jax.models.decoder import AttentionDecoder
from oxygen_jax.models.heads import AdaRmsHead, HeadSpec, TimeMlpHead, adarms, time_mlp
from oxygen_jax.models.mot import ModelParams, ModelSpec
from oxygen_jax.models.pi05.config import EOS_ID, ModelConfig
from oxygen_jax.models.pi05.observation import Observation
from oxygen_jax.models.pi05.params import Params
from oxygen_jax.models.pi05.spec import pi05_spec
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.models.vla import MultiHead

HEAD = "actions"
"""The name of π0.5's one head (in `as_model`, the runtime and the server)."""


def vlm_decoder(params: Params) -> Decoder:
    """The VLM expert with the embedder and the tied head as a `backbone.Decoder` (the same arrays, no copy).

    Run it with `pi05_spec(params.config)`; the action expert is the head `head_params(params)`.
    """
    return Decoder(embedding=params.embedding, layers=params.vlm.layers, final_norm=params.vlm.final_norm)


def head_spec(config: ModelConfig, num_steps: int = 10, horizon: int = 0) -> HeadSpec:
    """The action expert as head "actions": `adarms_joint` (π0.5) or `time_mlp_joint` (π0, with the state
    token); layer l reads the VLM expert's layer l.

    `horizon` 0 (default): the chunk length is the caller's (the noise's Ha); the expert is position-free in
    the horizon (its RoPE continues the prefix).
    """
    e = config.action_expert
    kind = adarms if config.variant == "pi05" else time_mlp
    return kind.head_spec(HEAD, width=e.width, depth=e.depth, num_heads=e.num_heads, num_kv_heads=e.num_kv_heads,
                          head_dim=e.head_dim, mlp_dim=e.mlp_dim, action_dim=config.action_dim, num_steps=num_steps,
                          horizon=horizon)


def head_params(params: Params) -> AdaRmsHead | TimeMlpHead:
    """The action expert's weights as the head's parameters (the same arrays, no copy)."""
    ae = params.action_expert
    if params.config.variant == "pi0":
        return TimeMlpHead(action_in=params.action_in, state_in=params.state_proj, time_mlp_in=params.time_mlp_in,
                           time_mlp_out=params.time_mlp_out, action_out=params.action_out, layers=ae.layers,
                           final_norm=ae.final_norm)
    return AdaRmsHead(action_in=params.action_in, time_mlp_in=params.time_mlp_in, time_mlp_out=params.time_mlp_out,
                      action_out=params.action_out, layers=ae.layers, final_norm=ae.final_norm)


def model_spec(config: ModelConfig, num_steps: int = 10, *, language: bool = True, horizon: int = 0) -> ModelSpec:
    """π0.5 as a `ModelSpec`: `pi05_spec(config)` (Gemma + SigLIP) + the head "actions" (+ the VLM expert
    as the language decoder)."""
    return ModelSpec(backbone=pi05_spec(config), heads=(head_spec(config, num_steps, horizon),), language=language,
                     stop_ids=(EOS_ID,))


def as_model(params: Params, num_steps: int = 10, *, language: bool = True) -> tuple[ModelSpec, ModelParams]:
    """π0.5 as the general model: (spec, weights) with the arrays of `params` (no copies).

    `mot.sample_all(*reversed(as_model(params)), ...)` and `models.vla.MultiHead` (`as_vla`) run it like any
    other model; inputs are `Observation`s. Layer layout (stacked / unstacked) is that of `params`.
    """
    heads = {HEAD: head_params(params)}
    return (model_spec(params.config, num_steps, language=language),
            ModelParams(decoder=vlm_decoder(params), vision=params.siglip, heads=heads))


def as_vla(params: Params, num_steps: int = 10) -> MultiHead:
    """π0.5 as the model the runtime drives (`Engine`, frame programs, the server): `MultiHead` of
    `as_model(params, num_steps)`, over the same arrays."""
    spec, weights = as_model(params, num_steps)
    return MultiHead(weights, spec)


def language_model(params: Params) -> AttentionDecoder:
    """The VLM expert as the decode pool's language decoder (`decoder.AttentionDecoder`; stops at EOS by
    default): the same arrays, no copy."""
    return AttentionDecoder(decoder=vlm_decoder(params), spec=pi05_spec(params.config), stop_ids=(EOS_ID,))


def embed_tokens(params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings [..., D] scaled by sqrt(D) (the factor rounded to the table dtype first)."""
    return backbone.embed_tokens(pi05_spec(params.config), vlm_decoder(params), tokens)


def lm_logits(params: Params, hidden: jax.Array) -> jax.Array:
    """Tied LM head: final-normed hidden [..., D] -> float32 logits [..., V]."""
    return backbone.lm_logits(pi05_spec(params.config), vlm_decoder(params), hidden)


def lm_logits_vocab_major(params: Params, hidden: jax.Array) -> jax.Array:
    """Tied LM head in vocabulary-major layout: hidden [B, D] -> float32 logits [V, B].

    Same values as `lm_logits(...).T`; this contraction order is the fast one on XLA's CPU backend
    for decode batches (see `sampling`).
    """
    return backbone.lm_logits_vocab_major(pi05_spec(params.config), vlm_decoder(params), hidden)


def final_norm(params: Params, hidden: jax.Array) -> jax.Array:
    """The VLM expert's final RMSNorm: [..., D] -> [..., D] (what the LM head reads)."""
    return backbone.final_norm(pi05_spec(params.config), vlm_decoder(params), hidden)


def embed_prefix(params: Params, obs: Observation) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Image tokens of every present camera, then prompt embeddings (`siglip_prefix.embed_prefix`).

    Returns:
      (tokens [B, P, D], input_mask bool [B, P], ar bool [P]).
    """
    return siglip_prefix.embed_prefix(pi05_spec(params.config), vlm_decoder(params), params.siglip, obs)


def prefix_forward(params: Params, obs: Observation) -> dict[str, jax.Array]:
    """The prefix pass with every intermediate (for parity checks and debugging).

    Returns a dict with `tokens`, `input_mask`, `ar`, `positions`, `hidden` (pre final norm,
    [B, P, D]), `k`, `v` ([L, B, P, K, H]).
    """
    return siglip_prefix.prefix_forward(pi05_spec(params.config), vlm_decoder(params), params.siglip, obs)


@jax.jit
def prefill(params: Params, observation: Observation) -> Prefix:
    """Runs SigLIP and the VLM expert over the prefix once: `mot.prefix_pass` of `as_model(params)`.

    Args:
      params: model parameters (their static `config` selects dtype and prompt attention).
      observation: images [B, Nc, Px, Px, 3], masks, prompt tokens [B, Tp].
    Returns:
      The prefix (every layer's K/V and the last valid token's final-normed output, no hidden
      states kept), P = Nc * Np + Tp positions.
    """
    spec, model = as_model(params)
    return mot.prefix_pass(spec, model, observation)


def prefix_length(params: Params, observation: Observation) -> int:
    """P of the cache `prefill(params, observation)` builds, read off the traced cache (nothing runs).

    The one source of the prefix length: decode pools are sized from it, so it can never disagree
    with the cache a pool is asked to continue (cameras, dropped padding cameras, prompt buckets).
    """
    return jax.eval_shape(prefill, params, observation).length


posemb_sincos = adarms.posemb_sincos


def time_condition(params: Params, t: jax.Array) -> jax.Array:
    """π0.5's adaRMS condition [B, Da] = swish(time_mlp_out(swish(time_mlp_in(sincos(t))))) (`adarms.time_condition`)."""
    return adarms.time_condition(head_params(params), t)


def _head_state(params: Params, cache: Prefix, state: jax.Array | None, num_steps: int = 10):
    head, spec = head_params(params), head_spec(params.config, num_steps)
    if params.config.variant == "pi05" and state is not None:
        raise ValueError("π0.5 reads the robot state as prompt tokens: pass state=None (π0 takes it as a token)")
    return head, spec, hd.prepare(head, spec, cache, state)


def velocity(params: Params, cache: Prefix, x_t: jax.Array, t: jax.Array, state: jax.Array | None = None) -> jax.Array:
    """Flow-matching velocity v(x_t, t) [B, Ha, Ad] from the action expert reading the prefix cache.

    Args:
      cache: read-only prefix cache.
      x_t: noisy actions [B, Ha, Ad].
      t: times [B], or one per action token [B, Ha] (π0.5's per-token adaRMS conditioning, training-time RTC).
      state: π0: the normalised robot state zero-padded to Ad, [B, Ad] (its state token); π0.5: None.
    """
    head, spec, st = _head_state(params, cache, state)
    return hd.velocity(head, spec, st, x_t, t)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def denoise(params: Params, cache: Prefix, noise: jax.Array, num_steps: int = 10, state: jax.Array | None = None) -> jax.Array:
    """Euler integration of the flow from t = 1 (noise) to t = 0 (actions): `heads.denoise` of the head "actions".

    The cache is read, never written, and not donated: text decoding can share it.

    Args:
      noise: x(t=1) [B, Ha, Ad].
      num_steps: static step count.
      state: π0's state [B, Ad] (normalised, zero-padded); None for π0.5.
    Returns:
      normalised, padded actions float32 [B, Ha, Ad].
    """
    head, spec, st = _head_state(params, cache, state, num_steps)
    return hd.denoise(head, spec, st, noise)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def sample_actions(params: Params, observation: Observation, noise: jax.Array, num_steps: int = 10,
                   state: jax.Array | None = None) -> jax.Array:
    """`denoise(prefill(observation))`: one action chunk [B, Ha, Ad] per observation row (π0: `state` [B, Ad])."""
    return denoise(params, prefill(params, observation), noise, num_steps, state)


@jax.jit
def compute_loss(params: Params, observation: Observation, actions: jax.Array, noise: jax.Array, time: jax.Array,
                 state: jax.Array | None = None) -> jax.Array:
    """Flow-matching loss with explicit noise and time.

    x_t = t * noise + (1 - t) * actions; target u_t = noise - actions.

    Args:
      actions, noise: [B, Ha, Ad]; time: [B] in (0, 1]; state: π0's [B, Ad], None for π0.5.
    Returns:
      per-step loss [B, Ha] = mean over A of (v_t - u_t)^2.
    """
    t = time[:, None, None]
    x_t = t * noise + (1 - t) * actions
    v_t = velocity(params, prefill(params, observation), x_t, time, state)
    return jnp.mean(jnp.square(v_t - (noise - actions)), axis=-1)


def sample_noise_and_time(rng: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """openpi's draws: split(rng, 3) -> (preprocess, noise, time); t = Beta(1.5, 1) * 0.999 + 0.001."""
    _, k_noise, k_time = jax.random.split(rng, 3)
    noise = jax.random.normal(k_noise, shape)
    time = jax.random.beta(k_time, 1.5, 1.0, shape[:1]) * 0.999 + 0.001
    return noise, time


def compute_loss_rng(params: Params, rng: jax.Array, observation: Observation, actions: jax.Array,
                     state: jax.Array | None = None) -> jax.Array:
    """`compute_loss` with noise and time drawn from `rng` the way openpi draws them."""
    noise, time = sample_noise_and_time(rng, actions.shape)
    return compute_loss(params, observation, actions, noise, time, state)
