"""SigLIP image encoder (ViT, no class token, no pooling) with a Dense head into the VLM width: its config,
its parameter tree and the encoder.

Axes (`oxygen_jax.axes`): B images, Px image side, p patch size, Np = (Px / p)^2 patches, W width,
Nv heads, Hv head dim, Fv MLP hidden, D VLM width.

The stem (patch projection + position embedding) runs in float32, like openpi; the encoder runs in
the compute dtype. The patch "convolution" (kernel p, stride p, VALID) is computed as a reshape into
patches followed by one matmul, which is the same linear map.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from oxygen_jax.nn.layers import Dense, LayerNorm, _pytree, layer_norm, scan_layers

_LN_EPS = 1e-6


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SiglipConfig:
    """SigLIP vision encoder (no pooling, a Dense head into the VLM width)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    patch_size: int = 14
    image_size: int = 224  # square input images, pixels per side

    def __post_init__(self):
        _require(self.width % self.num_heads == 0, "SiglipConfig.width must be divisible by num_heads")
        _require(
            self.image_size % self.patch_size == 0,
            f"SiglipConfig.image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})",
        )

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def num_patches(self) -> int:
        """Image tokens per camera (256 for 224 px and patch 14)."""
        return (self.image_size // self.patch_size) ** 2


@_pytree
class SiglipLayers:
    ln0: LayerNorm
    query: Dense  # kernel [L, W, Nv, Hv], bias [L, Nv, Hv]
    key: Dense
    value: Dense
    out: Dense  # kernel [L, Nv, Hv, W], bias [L, W]
    ln1: LayerNorm
    mlp_in: Dense  # [L, W, Fv]
    mlp_out: Dense  # [L, Fv, W]


@_pytree
class Siglip:
    patch: Dense  # kernel [p, p, 3, W] (HWIO), bias [W]
    pos_embedding: jax.Array  # [1, Np, W]
    layers: SiglipLayers
    norm: LayerNorm  # [W]
    head: Dense  # [W, D_vlm]

    def with_layers(self, lay_out) -> "Siglip":
        """The same encoder with its layer stack laid out by `lay_out` (`nn.layers.stack_layers` / `unstack_layers`)."""
        return dataclasses.replace(self, layers=lay_out(self.layers))


def _patchify(images: jax.Array, p: int) -> jax.Array:
    """[B, Px, Px, 3] -> [B, Np, p*p*3], patches in row-major order, pixels as (row, col, channel)."""
    b, s, _, c = images.shape
    g = s // p
    x = images.reshape(b, g, p, g, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, g * g, p * p * c)


def stem(params: Siglip, images: jax.Array) -> jax.Array:
    """Patch embedding before the position embedding: [B, Px, Px, 3] -> float32 [B, Np, W]."""
    p = params.patch.kernel.shape[0]
    w = params.patch.kernel.reshape(-1, params.patch.kernel.shape[-1]).astype(jnp.float32)
    return _patchify(images.astype(jnp.float32), p) @ w + params.patch.bias.astype(jnp.float32)


def _encoder_block(x: jax.Array, lp) -> jax.Array:
    dt = x.dtype
    h = layer_norm(x, lp.ln0, _LN_EPS)
    q, k, v = (
        jnp.einsum("BTW,WNH->BTNH", h, d.kernel.astype(dt)) + d.bias.astype(dt) for d in (lp.query, lp.key, lp.value)
    )
    q = q / jnp.sqrt(jnp.asarray(q.shape[-1], dt))
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    a = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
    x = x + jnp.einsum("BTNH,NHW->BTW", a, lp.out.kernel.astype(dt)) + lp.out.bias.astype(dt)
    h = layer_norm(x, lp.ln1, _LN_EPS)
    h = jax.nn.gelu(h @ lp.mlp_in.kernel.astype(dt) + lp.mlp_in.bias.astype(dt), approximate=True)
    return x + h @ lp.mlp_out.kernel.astype(dt) + lp.mlp_out.bias.astype(dt)


def encode_stages(params: Siglip, images: jax.Array, dtype) -> dict[str, jax.Array]:
    """All intermediate outputs, for parity checks.

    Args:
      images: [B, Px, Px, 3] in [-1, 1].
    Returns:
      {"stem": [B, Np, W] float32, "encoded": [B, Np, W] (after the final LayerNorm),
       "tokens": [B, Np, D] (after the head)}.
    """
    s = stem(params, images)
    if s.shape[1] != params.pos_embedding.shape[1]:
        raise ValueError(
            f"images give {s.shape[1]} patches but the position embedding has {params.pos_embedding.shape[1]}; "
            "resize images to the model's image size"
        )
    x = (s + params.pos_embedding.astype(jnp.float32)).astype(dtype)
    x, _ = scan_layers(lambda x, lp, _, __: (_encoder_block(x, lp), None), x, params.layers)
    encoded = layer_norm(x, params.norm, _LN_EPS)
    tokens = encoded @ params.head.kernel.astype(dtype) + params.head.bias.astype(dtype)
    return {"stem": s, "encoded": encoded, "tokens": tokens}


def encode(params: Siglip, images: jax.Array, dtype) -> jax.Array:
    """Image tokens [B, Np, D] for images [B, Px, Px, 3] in [-1, 1]."""
    return encode_stages(params, images, dtype)["tokens"]
