"""π0.5 as pure functions: prefill an observation once, then denoise actions from its cache.

Axes (`oxygen_jax.axes`): B batch, Nc cameras, Np patches per camera, Tp prompt tokens,
P = Nc*Np + Tp prefix tokens, Ha action horizon, Ad model action dim (32), D VLM width, Da action-expert
width.

Sequence layout and attention (openpi π0.5, with padding cameras dropped rather than masked):

    prefix  [cam_0 Np | cam_1 Np | ... | prompt Tp]   expert 0, bidirectional over valid tokens
            (prompt tokens are causal instead when config.prompt_attention == "causal")
    suffix  [Ha noisy-action tokens]                  expert 1, sees every valid prefix token and
                                                      the whole suffix; prefix never sees suffix
    positions: prefix cumsum(mask) - 1; suffix next_position (= num_valid) + [0, Ha)

Both experts run on the one transformer implementation, `backbone`, as instances of its spec
(`spec.py`): `pi05_spec(config, "vlm")` (with the embedder and tied head, `vlm_decoder`) and
`pi05_spec(config, "action_expert")` (a bare stack with adaRMSNorm).

Flow matching: t = 1 is noise, t = 0 is data; `denoise` runs `num_steps` Euler steps with
dt = -1/num_steps on a read-only prefix cache (`flow.integrate`, time accumulated in float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone, flow, siglip
from oxygen_jax.models.backbone import Decoder
from oxygen_jax.models.pi05.observation import Observation, validate_observation
from oxygen_jax.models.pi05.params import Params
from oxygen_jax.models.pi05.spec import pi05_spec
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import dense
from oxygen_jax.nn.masks import last_valid_index, make_attn_mask, positions_from_mask


def vlm_decoder(params: Params) -> Decoder:
    """The VLM expert with the embedder and the tied head as a `backbone.Decoder` (the same arrays, no copy).

    Run it with `pi05_spec(params.config)`; the action expert is a bare stack
    (`params.action_expert.layers` with `pi05_spec(params.config, "action_expert")`).
    """
    return Decoder(embedding=params.embedding, layers=params.vlm.layers, final_norm=params.vlm.final_norm)


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
    """Image tokens of every present camera, then prompt embeddings.

    Returns:
      (tokens [B, P, D], input_mask bool [B, P], ar bool [P]).
    """
    cfg = params.config
    validate_observation(obs, cfg)
    b, c = obs.images.shape[:2]
    images = obs.images.reshape((b * c,) + obs.images.shape[2:])
    img = siglip.encode(params.siglip, images, cfg.jnp_dtype)
    np_ = img.shape[1]
    img = img.reshape(b, c * np_, img.shape[-1])
    txt = embed_tokens(params, obs.tokens).astype(cfg.jnp_dtype)
    tokens = jnp.concatenate([img, txt], axis=1)
    input_mask = jnp.concatenate([jnp.repeat(obs.image_masks, np_, axis=1), obs.token_mask], axis=1)
    prompt_ar = cfg.prompt_attention == "causal"
    ar = jnp.concatenate([jnp.zeros(c * np_, bool), jnp.full(obs.tokens.shape[1], prompt_ar)])
    return tokens, input_mask, ar


def prefix_forward(params: Params, obs: Observation) -> dict[str, jax.Array]:
    """The prefix pass with every intermediate (for parity checks and debugging).

    Returns a dict with `tokens`, `input_mask`, `ar`, `positions`, `hidden` (pre final norm,
    [B, P, D]), `k`, `v` ([L, B, P, K, H]).
    """
    tokens, input_mask, ar = embed_prefix(params, obs)
    positions = positions_from_mask(input_mask)
    mask = make_attn_mask(input_mask, ar)
    hidden, (k, v) = backbone.forward_prefill(pi05_spec(params.config), params.vlm.layers, tokens, positions, mask)
    return dict(tokens=tokens, input_mask=input_mask, ar=ar, positions=positions, hidden=hidden, k=k, v=v)


@jax.jit
def prefill(params: Params, observation: Observation) -> Prefix:
    """Runs SigLIP and the VLM expert over the prefix once.

    Args:
      params: model parameters (their static `config` selects dtype and prompt attention).
      observation: images [B, Nc, Px, Px, 3], masks, prompt tokens [B, Tp].
    Returns:
      The prefix (every layer's K/V, no hidden states kept), P = Nc * Np + Tp positions.
    """
    out = prefix_forward(params, observation)
    last = last_valid_index(out["input_mask"])
    h_last = jnp.take_along_axis(out["hidden"], last[:, None, None], axis=1)
    h_last = final_norm(params, h_last)
    return Prefix.every_layer(out["k"], out["v"], out["input_mask"], out["positions"], h_last[:, 0],
                              pi05_spec(params.config).rope)


def prefix_length(params: Params, observation: Observation) -> int:
    """P of the cache `prefill(params, observation)` builds, read off the traced cache (nothing runs).

    The one source of the prefix length: decode pools are sized from it, so it can never disagree
    with the cache a pool is asked to continue (cameras, dropped padding cameras, prompt buckets).
    """
    return jax.eval_shape(prefill, params, observation).length


def posemb_sincos(t: jax.Array, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> jax.Array:
    """Sine-cosine embedding of scalar times t [B] -> float32 [B, dim], sine half first."""
    fraction = jnp.linspace(0.0, 1.0, dim // 2)
    period = min_period * (max_period / min_period) ** fraction
    arg = jnp.einsum("i,j->ij", t.astype(jnp.float32), 1.0 / period * 2 * jnp.pi, precision=jax.lax.Precision.HIGHEST)
    return jnp.concatenate([jnp.sin(arg), jnp.cos(arg)], axis=-1)


def time_condition(params: Params, t: jax.Array) -> jax.Array:
    """adaRMS condition [B, Da] = swish(time_mlp_out(swish(time_mlp_in(sincos(t)))))."""
    dt = params.config.jnp_dtype
    emb = posemb_sincos(t, params.time_mlp_in.kernel.shape[0]).astype(dt)
    return jax.nn.swish(dense(params.time_mlp_out, jax.nn.swish(dense(params.time_mlp_in, emb))))


def velocity(params: Params, cache: Prefix, x_t: jax.Array, t: jax.Array) -> jax.Array:
    """Flow-matching velocity v(x_t, t) [B, Ha, Ad] from the action expert reading the prefix cache.

    Args:
      cache: read-only prefix cache.
      x_t: noisy actions [B, Ha, Ad].
      t: times [B].
    """
    dt = params.config.jnp_dtype
    b, ha = x_t.shape[:2]
    cond = time_condition(params, t)
    x = dense(params.action_in, x_t.astype(dt))
    positions = cache.next_position[:, None] + jnp.arange(ha, dtype=jnp.int32)[None]
    suffix_ar = jnp.arange(ha) == 0  # one block: bidirectional inside the chunk
    suffix_mask = make_attn_mask(jnp.ones((b, ha), bool), suffix_ar)
    mask = jnp.concatenate([jnp.broadcast_to(cache.mask[:, None, :], (b, ha, cache.length)), suffix_mask], axis=-1)
    spec = pi05_spec(params.config, "action_expert")
    h = backbone.forward_read(spec, params.action_expert.layers, x, positions, mask, cache.k, cache.v, cond)
    h, _ = backbone.rms_norm(spec, h, params.action_expert.final_norm, cond)
    return dense(params.action_out, h).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def denoise(params: Params, cache: Prefix, noise: jax.Array, num_steps: int = 10) -> jax.Array:
    """Euler integration of the flow from t = 1 (noise) to t = 0 (actions).

    The cache is read, never written, and not donated: text decoding can share it.

    Args:
      noise: x(t=1) [B, Ha, Ad].
      num_steps: static step count.
    Returns:
      normalised, padded actions float32 [B, Ha, Ad].
    """
    b = noise.shape[0]
    v = lambda x, t: velocity(params, cache, x, jnp.broadcast_to(t, (b,)))  # noqa: E731
    return flow.integrate(v, noise, num_steps, -1.0, t0=1.0)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def sample_actions(params: Params, observation: Observation, noise: jax.Array, num_steps: int = 10) -> jax.Array:
    """`denoise(prefill(observation))`: one action chunk [B, Ha, Ad] per observation row."""
    return denoise(params, prefill(params, observation), noise, num_steps)


@jax.jit
def compute_loss(params: Params, observation: Observation, actions: jax.Array, noise: jax.Array, time: jax.Array) -> jax.Array:
    """Flow-matching loss with explicit noise and time.

    x_t = t * noise + (1 - t) * actions; target u_t = noise - actions.

    Args:
      actions, noise: [B, Ha, Ad]; time: [B] in (0, 1].
    Returns:
      per-step loss [B, Ha] = mean over A of (v_t - u_t)^2.
    """
    t = time[:, None, None]
    x_t = t * noise + (1 - t) * actions
    v_t = velocity(params, prefill(params, observation), x_t, time)
    return jnp.mean(jnp.square(v_t - (noise - actions)), axis=-1)


def sample_noise_and_time(rng: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """openpi's draws: split(rng, 3) -> (preprocess, noise, time); t = Beta(1.5, 1) * 0.999 + 0.001."""
    _, k_noise, k_time = jax.random.split(rng, 3)
    noise = jax.random.normal(k_noise, shape)
    time = jax.random.beta(k_time, 1.5, 1.0, shape[:1]) * 0.999 + 0.001
    return noise, time


def compute_loss_rng(params: Params, rng: jax.Array, observation: Observation, actions: jax.Array) -> jax.Array:
    """`compute_loss` with noise and time drawn from `rng` the way openpi draws them."""
    noise, time = sample_noise_and_time(rng, actions.shape)
    return compute_loss(params, observation, actions, noise, time)
