"""π0-FAST as pure functions: one PaliGemma (SigLIP + the Gemma VLM) whose action chunks are FAST tokens.

Axes (`oxygen_jax.axes`): B batch, Nc cameras, Np patches per camera, Tp text tokens, P = Nc*Np + Tp input
tokens, L layers, K KV heads, H head dim, D VLM width, V vocabulary.

openpi's `Pi0FAST` has no action expert: the VLM reads images and a bidirectional prompt, then decodes the
chunk causally as text (`robots.fast_prompt` writes and reads that text):

    inputs  [cam_0 Np | ... | cam_Nc-1 Np | text Tp]
    text    BOS "Task: <prompt>, State: <bins>;\\n"          ar 0: bidirectional with the images
            "Action: " FAST ids (mapped into V) "|" EOS      ar 1: causal (training only; decoded at inference)
    mask    `make_attn_mask(input_mask, ar)` over the whole sequence

Teacher forcing (`teacher_forced`, `compute_loss`: openpi's `compute_loss`) runs all but the last input with
positions 0..P-2 (an arange, not cumsum(mask) - 1: a masked camera's tokens still advance the position) and
reads the logits of the text positions only (text position j predicts text token j + 1).

Decoding runs on the same arrays: `pi0_fast_decode` (openpi's right-aligned prefill and greedy loop, the
reference), or the decode slot pool on `prefix(params, obs)` with `language_model(params)` (the same tokens
when every camera is present: tested). `as_vla` is what the runtime serves: one action stream per robot in the
shared pool (`runtime.action_streams`), language requests beside it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone
from oxygen_jax.models.vision import siglip_prefix
from oxygen_jax.models.backbone import BackboneSpec, Decoder
from oxygen_jax.models.decoded_actions import ActionStream, DecodedActions
from oxygen_jax.models.decoder import AttentionDecoder
from oxygen_jax.models.mot import ModelParams, ModelSpec
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.pi05.config import EOS_ID, Pi0FastConfig
from oxygen_jax.models.pi05.params import Pi0FastParams
from oxygen_jax.models.pi05.spec import gemma_spec
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.masks import make_attn_mask


def spec(config: Pi0FastConfig) -> BackboneSpec:
    """The VLM as a `BackboneSpec`: π0.5's Gemma maths (`pi05.spec.gemma_spec`) with SigLIP, bidirectional prefix."""
    return gemma_spec(config.vlm, vocab_size=config.vocab_size, prefix_attention="bidirectional",
                      vision=config.siglip, embed_scale_dtype=config.embed_scale_dtype)


def decoder(params: Pi0FastParams) -> Decoder:
    """The VLM with the embedder and the tied head as a `backbone.Decoder` (the same arrays, no copy)."""
    return Decoder(embedding=params.embedding, layers=params.vlm.layers, final_norm=params.vlm.final_norm)


def language_model(params: Pi0FastParams) -> AttentionDecoder:
    """The VLM as the decode pool's language decoder (stops at EOS by default): the same arrays, no copy."""
    return AttentionDecoder(decoder=decoder(params), spec=spec(params.config), stop_ids=(EOS_ID,))


def embed_inputs(params: Pi0FastParams, obs: Observation, token_ar: jax.Array | None = None):
    """Image tokens of every camera, then the text embeddings (table[id] * sqrt(D)): openpi's `embed_inputs`.

    Args:
      obs: images [B, Nc, Px, Px, 3], image_masks [B, Nc], tokens / token_mask [B, Tp].
      token_ar: int or bool [B, Tp], 1 on the causal (postfix) text tokens; None: all 0 (an inference prompt).
    Returns:
      (tokens [B, P, D], input_mask bool [B, P], ar bool [B, P]); image tokens have ar 0.
    """
    x, input_mask, _ = siglip_prefix.embed_prefix(spec(params.config), decoder(params), params.siglip, obs)
    b, t = obs.tokens.shape
    text_ar = jnp.zeros((b, t), bool) if token_ar is None else jnp.asarray(token_ar).astype(bool)
    if text_ar.shape != (b, t):
        raise ValueError(f"token_ar must be [batch, text] = {(b, t)} like the tokens, got {tuple(text_ar.shape)}")
    ar = jnp.concatenate([jnp.zeros((b, x.shape[1] - t), bool), text_ar], axis=1)
    return x, input_mask, ar


@jax.jit
def teacher_forced(params: Pi0FastParams, obs: Observation, token_ar: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced logits over the whole text, and the log-probability of each next token.

    One pass over inputs 0..P-2 at positions 0..P-2 (openpi's `compute_loss`); the logits of the last Tp - 1
    inputs are kept. Query rows of invalid inputs (padding, a masked camera) attend to nothing valid and give
    openpi's values there too (uniform attention), so every text position is comparable.

    Args:
      obs: the training sequence (prompt + "Action: " + FAST + "|" + EOS, 0-padded) as tokens / token_mask.
      token_ar: [B, Tp] (`robots.fast_prompt.FastTokens.ar`).
    Returns:
      (logits float32 [B, Tp - 1, V] (text position j predicts text token j + 1),
       target_logp float32 [B, Tp - 1]: log p(text token j + 1)).
    """
    x, input_mask, ar = embed_inputs(params, obs, token_ar)
    b, p = input_mask.shape
    t = obs.tokens.shape[1]
    sp, dec = spec(params.config), decoder(params)
    mask = make_attn_mask(input_mask, ar)[:, :-1, :-1]
    positions = jnp.broadcast_to(jnp.arange(p - 1, dtype=jnp.int32), (b, p - 1))
    hidden, _ = backbone.forward_prefill(sp, dec.layers, x[:, :-1], positions, mask, keep_kv=())
    normed = backbone.final_norm(sp, dec, hidden[:, -(t - 1):])
    logits = backbone.lm_logits(sp, dec, normed)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logp, obs.tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    return logits, target


@jax.jit
def compute_loss(params: Pi0FastParams, obs: Observation, token_ar: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """openpi's π0-FAST loss per row [B]: -sum(loss_mask[1:] * log p(next token)) / max(sum(loss_mask[1:]), 1).

    Args:
      token_ar, loss_mask: [B, Tp] (`robots.fast_prompt.FastTokens`; loss_mask True on the postfix).
    """
    _, target = teacher_forced(params, obs, token_ar)
    weight = jnp.asarray(loss_mask)[:, 1:].astype(jnp.float32)
    return -jnp.sum(target * weight, axis=-1) / jnp.maximum(jnp.sum(weight, axis=-1), 1.0)


@jax.jit
def prefix(params: Pi0FastParams, obs: Observation) -> Prefix:
    """The inference prefix as the decode pool continues it: every layer's K/V, the last valid token's output.

    The prefix pass of π0.5 (`siglip_prefix.prefix_pass`: positions cumsum(mask) - 1, bidirectional), with
    openpi's first decode position: openpi feeds decoded token i at position prefill_len + i + 1, never using
    prefill_len itself, so `next_position` is num_valid + 1 here (e.g. 809 valid inputs: token 0 at 810).
    """
    out = siglip_prefix.prefix_pass(spec(params.config), decoder(params), params.siglip, obs)
    return dataclasses.replace(out, next_position=out.next_position + 1)


def as_vla(params: Pi0FastParams, stream: ActionStream) -> DecodedActions:
    """π0-FAST as the model the runtime drives: no heads, a language decoder whose `stream` writes the chunks,
    the prefix of `prefix` (openpi's skipped first position). The same arrays, no copy."""
    model = ModelSpec(backbone=spec(params.config), heads=(), language=True, stop_ids=(EOS_ID,))
    return DecodedActions(ModelParams(decoder=decoder(params), vision=params.siglip, heads={}), model, stream=stream,
                          position_skip=1)
