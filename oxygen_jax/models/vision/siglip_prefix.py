"""The prefix pass of a backbone with a SigLIP vision encoder (π0.5's prefill): images of every present
camera, then the prompt, through the backbone once.

Axes (`oxygen_jax.axes`): B batch, Nc cameras, Np patches per camera, Tp prompt tokens,
P = Nc*Np + Tp prefix tokens, L layers, K KV heads, H head dim, D backbone width.

Sequence layout (openpi π0.5, with padding cameras dropped rather than masked):

    prefix  [cam_0 Np | cam_1 Np | ... | prompt Tp]   bidirectional over valid tokens; prompt tokens
                                                      causal instead with spec.prefix_attention == "causal"
    positions cumsum(mask) - 1; a continuation (action suffix, text) starts at next_position = num_valid

Example (Nc = 2, Np = 2, Tp = 3, camera 1 masked, prompt [bos, a, pad]):
    mask      1 1 0 0 1 1 0
    positions 0 1 1 1 2 3 3     (masked tokens repeat a position and are never attended to)
    next_position = 4

Input: `models.observation.Observation`. Output: `models.prefix.Prefix` with the K/V of the layers a
model reads, HF-convention hidden states when a head reads them, and the last valid token's
final-normed output when a language decoder reads the prefix.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone as bb
from oxygen_jax.models.vision import siglip
from oxygen_jax.models.backbone import BackboneSpec, Decoder, Draw
from oxygen_jax.models.observation import Observation, validate
from oxygen_jax.models.prefix import Prefix, next_positions
from oxygen_jax.models.vision.siglip import Siglip, SiglipConfig, SiglipLayers
from oxygen_jax.nn.layers import Dense, LayerNorm
from oxygen_jax.nn.masks import last_valid_index, make_attn_mask, positions_from_mask


def _vision(spec: BackboneSpec) -> SiglipConfig:
    if not isinstance(spec.vision, SiglipConfig):
        raise ValueError(f"this backbone has no SigLIP encoder (vision={type(spec.vision).__name__}); "
                         "give it a SiglipConfig or feed it mot.PrefixInputs")
    return spec.vision


def check_observation(spec: BackboneSpec, obs: Observation) -> None:
    """Raises ValueError naming the first problem with `obs` for this backbone (see `observation.validate`)."""
    validate(obs, image_size=_vision(spec).image_size, vocab_size=spec.vocab_size)


def embed_prefix(spec: BackboneSpec, decoder: Decoder, vision: Siglip, obs: Observation):
    """Image tokens of every present camera, then prompt embeddings, in the decoder's dtype.

    Returns:
      (tokens [B, P, D], input_mask bool [B, P], ar bool [P]).
    """
    check_observation(spec, obs)
    dtype = decoder.embedding.dtype
    b, c = obs.images.shape[:2]
    images = obs.images.reshape((b * c,) + obs.images.shape[2:])
    img = siglip.encode(vision, images, dtype)
    np_ = img.shape[1]
    img = img.reshape(b, c * np_, img.shape[-1])
    txt = bb.embed_tokens(spec, decoder, obs.tokens).astype(dtype)
    tokens = jnp.concatenate([img, txt], axis=1)
    input_mask = jnp.concatenate([jnp.repeat(obs.image_masks, np_, axis=1), obs.token_mask], axis=1)
    prompt_ar = spec.prefix_attention == "causal"
    ar = jnp.concatenate([jnp.zeros(c * np_, bool), jnp.full(obs.tokens.shape[1], prompt_ar)])
    return tokens, input_mask, ar


def prefix_forward(spec: BackboneSpec, decoder: Decoder, vision: Siglip, obs: Observation) -> dict[str, jax.Array]:
    """The prefix pass with every intermediate (for parity checks and debugging).

    Returns a dict with `tokens`, `input_mask`, `ar`, `positions`, `hidden` (pre final norm,
    [B, P, D]), `k`, `v` ([L, B, P, K, H]).
    """
    tokens, input_mask, ar = embed_prefix(spec, decoder, vision, obs)
    positions = positions_from_mask(input_mask)
    mask = make_attn_mask(input_mask, ar)
    hidden, (k, v) = bb.forward_prefill(spec, decoder.layers, tokens, positions, mask)
    return dict(tokens=tokens, input_mask=input_mask, ar=ar, positions=positions, hidden=hidden, k=k, v=v)


def prefix_pass(spec: BackboneSpec, decoder: Decoder, vision: Siglip, obs: Observation, *,
                kv_layers: tuple[int, ...] | None = None, hidden_layers: tuple[int, ...] = (),
                last_hidden: bool = True) -> Prefix:
    """SigLIP per camera and the backbone over the prefix, once; keeps what the readers need.

    Args:
      kv_layers: layers whose K/V are kept (None: every layer, what π0.5's action expert and a
        language decoder read).
      hidden_layers: HF hidden-state indices kept (0 = embeddings, L = final-normed output); () keeps none.
      last_hidden: keep the last valid token's final-normed output [B, D] (language decoding).
    Returns:
      `Prefix` of P = Nc * Np + Tp positions.
    """
    tokens, input_mask, ar = embed_prefix(spec, decoder, vision, obs)
    positions = positions_from_mask(input_mask)
    mask = make_attn_mask(input_mask, ar)
    every = tuple(range(spec.depth))
    keep = None if kv_layers is None or tuple(kv_layers) == every else tuple(kv_layers)
    hidden_states = None
    if hidden_layers:
        out = bb.prefill(spec, decoder, tokens, positions, input_mask, mask=mask, keep_kv=keep,
                         keep_hidden=tuple(hidden_layers))
        hidden, k, v, hidden_states = out["hidden"], out["k"], out["v"], out["hidden_states"]
    else:
        hidden, (k, v) = bb.forward_prefill(spec, decoder.layers, tokens, positions, mask, keep_kv=keep)
    last = None
    if last_hidden:  # the norm of the last valid row only (what π0.5's prefill always computed)
        h_last = jnp.take_along_axis(hidden, last_valid_index(input_mask)[:, None, None], axis=1)
        last = bb.final_norm(spec, decoder, h_last)[:, 0]
    kept = every if keep is None else keep
    if not kept:
        k = v = None
    return Prefix(k=k, v=v, hidden=hidden_states, mask=input_mask, positions=positions,
                  next_position=next_positions(input_mask, positions), last_hidden=last, kv_layers=kept,
                  hidden_layers=tuple(hidden_layers), rope=spec.rope)


def siglip_tree(config: SiglipConfig, out_width: int, draw: Draw) -> Siglip:
    """SigLIP weights with every leaf from `draw` (fan-in scaled; LayerNorm scales around 1), head into
    `out_width`. For random test models; π0.5's own weights come from `models.pi05.params`."""
    w, n, hv, f, p, L = config.width, config.num_heads, config.head_dim, config.mlp_dim, config.patch_size, config.depth

    def dense(in_shape, out_shape, lead=()):
        return Dense(kernel=draw(lead + in_shape + out_shape, 1.0 / math.sqrt(math.prod(in_shape)), 0.0),
                     bias=draw(lead + out_shape, 0.1, 0.0))

    def ln(lead=()):
        return LayerNorm(scale=draw(lead + (w,), 0.1, 1.0), bias=draw(lead + (w,), 0.1, 0.0))

    layers = SiglipLayers(
        ln0=ln((L,)), query=dense((w,), (n, hv), (L,)), key=dense((w,), (n, hv), (L,)), value=dense((w,), (n, hv), (L,)),
        out=Dense(kernel=draw((L, n, hv, w), 1.0 / math.sqrt(n * hv), 0.0), bias=draw((L, w), 0.1, 0.0)),
        ln1=ln((L,)), mlp_in=dense((w,), (f,), (L,)), mlp_out=dense((f,), (w,), (L,)),
    )
    return Siglip(patch=dense((p, p, 3), (w,)), pos_embedding=draw((1, config.num_patches, w), 0.02, 0.0),
                  layers=layers, norm=ln(), head=dense((w,), (out_width,)))
