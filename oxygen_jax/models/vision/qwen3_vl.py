"""Qwen3-VL vision: patches, the ViT, the 2x2 mergers, DeepStack, and M-RoPE positions.

Axis legend: Np patches of all images (merge-window order), Pd = 3 channels × temporal patch × p × p
(p the patch side) one flattened patch, W ViT width, Nv heads, Hv head dim, Fv ViT MLP, m spatial merge size, Mw = m² patches per
LLM token, Ni = Np / Mw image tokens, D LLM width, Ed DeepStack layers, B batch, T text tokens,
Mr = 3 M-RoPE axes (t, h, w).

Patch order (HF's image processor): images one after another; inside an image, frame-major, then
m x m merge windows row-major, then the Mw patches of a window row-major, so the Mw patches of
one LLM token are consecutive. Example, an image of 4 x 4 patches and m = 2 (patch = (row, col)):

    (0,0) (0,1) (1,0) (1,1) | (0,2) (0,3) (1,2) (1,3) | (2,0) (2,1) (3,0) (3,1) | (2,2) ...
      window 0 -> token 0       window 1 -> token 1       window 2 -> token 2

The ViT: Conv3d patch embedding (a matmul over flattened patches) + a learned g x g position
grid resampled bilinearly to the image's patch grid (align_corners) + 2-D RoPE (row, col) inside
every block; attention stays within one frame of one image. The merger turns Mw patches into one
LLM token (LN over W -> concat Mw -> Linear -> GELU -> Linear to D). DeepStack mergers (LN after the
concat) turn the outputs of `deepstack_layers` blocks into features that are added to the LLM
residual at image positions after LLM layers 0..Ed-1 (`backbone.forward_prefill(deepstack=...)`).

M-RoPE positions (`mrope_positions`): text tokens count up on all three axes; an image of
gh x gw merged tokens starting at position s gets (s, s + row, s + col); the next text token is
at max(position so far) + 1. Decoded tokens continue at that row's max position + 1 + step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models import backbone
from oxygen_jax.models.backbone import BackboneSpec, Decoder, Qwen3VisionSpec
from oxygen_jax.nn.layers import Dense, LayerNorm, Unstacked, apply_rope, attention, dense, layer_norm, scan_layers

Grid = tuple[tuple[int, int, int], ...]  # per image (t, h, w) in patches, before merging


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class VisionBlocks:
    """ViT blocks, stacked on a leading L axis."""

    ln1: LayerNorm  # [L, W]
    qkv: Dense  # kernel [L, W, 3, Nv, Hv], bias [L, 3, Nv, Hv]; index 0 q, 1 k, 2 v
    out: Dense  # kernel [L, Nv, Hv, W], bias [L, W]
    ln2: LayerNorm  # [L, W]
    fc1: Dense  # [L, W, Fv]
    fc2: Dense  # [L, Fv, W]


@_pytree
class Merger:
    """Mw patches -> one LLM token. DeepStack mergers are stacked on a leading Ed axis."""

    norm: LayerNorm  # [(Ed,) W] for the main merger (before the concat), [(Ed,) Mw*W] for DeepStack (after)
    fc1: Dense  # [(Ed,) Mw*W, Mw*W]
    fc2: Dense  # [(Ed,) Mw*W, D]


@_pytree
class Vision:
    patch: Dense  # kernel [Pd, W] (Conv3d weight flattened in (C, Tp, P, P) order), bias [W]
    pos_embed: jax.Array  # [g*g, W] learned grid, row-major
    blocks: VisionBlocks | Unstacked
    merger: Merger
    deepstack: Merger | None  # leading Ed axis; None when there are no DeepStack layers

    def with_layers(self, lay_out) -> "Vision":
        """The same encoder with its block stack laid out by `lay_out` (`nn.layers.stack_layers` / `unstack_layers`)."""
        return dataclasses.replace(self, blocks=lay_out(self.blocks))


def vision_tree(vspec: Qwen3VisionSpec, draw: backbone.Draw) -> Vision:
    """The `Vision` tree of `vspec` with every leaf from `draw` (see `backbone.decoder_tree`)."""
    w, nv, hv, fv, d, mw, depth = vspec.width, vspec.num_heads, vspec.head_dim, vspec.mlp_dim, vspec.out_width, vspec.merge_width, vspec.depth
    e = len(vspec.deepstack_layers)

    def dense_leaf(lead, fan_in, out_shape):
        return Dense(kernel=draw(lead + (fan_in,) + out_shape, 1.0 / math.sqrt(fan_in), 0.0), bias=draw(lead + out_shape, 0.1, 0.0))

    def ln(shape):
        return LayerNorm(scale=draw(shape, 0.1, 1.0), bias=draw(shape, 0.1, 0.0))

    def merger(lead, norm_width):
        return Merger(norm=ln(lead + (norm_width,)), fc1=dense_leaf(lead, mw, (mw,)), fc2=dense_leaf(lead, mw, (d,)))

    blocks = VisionBlocks(
        ln1=ln((depth, w)), qkv=dense_leaf((depth,), w, (3, nv, hv)),
        out=Dense(kernel=draw((depth, nv, hv, w), 1.0 / math.sqrt(w), 0.0), bias=draw((depth, w), 0.1, 0.0)),
        ln2=ln((depth, w)), fc1=dense_leaf((depth,), w, (fv,)), fc2=dense_leaf((depth,), fv, (w,)),
    )
    return Vision(
        patch=dense_leaf((), vspec.patch_dim, (w,)), pos_embed=draw((vspec.num_position_embeddings, w), 0.02, 0.0),
        blocks=blocks, merger=merger((), w), deepstack=merger((e,), mw) if e else None,
    )


def init_vision(vspec: Qwen3VisionSpec, seed: int = 0, dtype: str = "float32") -> Vision:
    """Random ViT weights (tests and benchmarks)."""
    return vision_tree(vspec, backbone.numpy_draws(seed, dtype))


def abstract_vision(vspec: Qwen3VisionSpec, dtype: str = "float32") -> Vision:
    """`jax.ShapeDtypeStruct` leaves via `jax.eval_shape`: nothing is allocated."""
    return jax.eval_shape(lambda: vision_tree(vspec, backbone.zeros_draws(dtype)))


# --------------------------------------------------------------------------------------------------
# Host-side geometry (static per image grid)


def as_grid(grid_thw) -> Grid:
    """Image grids as a hashable tuple of (t, h, w) (a static jit argument)."""
    return tuple(tuple(int(v) for v in g) for g in np.asarray(grid_thw).reshape(-1, 3))


def _check_grid(vspec: Qwen3VisionSpec, grid: Grid) -> None:
    m = vspec.spatial_merge_size
    for t, h, w in grid:
        if t < 1 or h % m or w % m or h < m or w < m:
            raise ValueError(f"image grid (t={t}, h={h}, w={w}) patches: h and w must be positive multiples of "
                             f"spatial_merge_size={m}; resize the image to a multiple of {vspec.patch_size * m} px")


def _window_order(t: int, h: int, w: int, m: int) -> np.ndarray:
    """Row-major patch index of each patch in merge-window order (frames repeat the image's patches)."""
    idx = np.arange(h * w).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(idx, t)


def _pos_interp(vspec: Qwen3VisionSpec, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear resampling (align_corners) of the g x g grid to every image: indices, weights [4, Np].

    Corner c in (floor-row floor-col, floor-row ceil-col, ceil-row floor-col, ceil-row ceil-col).
    """
    g, m = vspec.grid_side, vspec.spatial_merge_size
    idx, wts = [], []
    for t, h, w in grid:
        hi = np.linspace(0, g - 1, h).astype(np.float32)
        wi = np.linspace(0, g - 1, w).astype(np.float32)
        hf, wf = hi.astype(np.int64), wi.astype(np.int64)
        hc, wc = np.minimum(hf + 1, g - 1), np.minimum(wf + 1, g - 1)
        dh, dw = hi - hf.astype(np.float32), wi - wf.astype(np.float32)
        corners = [(hf, wf, 1 - dh, 1 - dw), (hf, wc, 1 - dh, dw), (hc, wf, dh, 1 - dw), (hc, wc, dh, dw)]
        order = _window_order(t, h, w, m)
        idx.append(np.stack([(r[:, None] * g + c[None, :]).reshape(-1)[order] for r, c, _, _ in corners]))
        wts.append(np.stack([(a[:, None] * b[None, :]).reshape(-1)[order] for _, _, a, b in corners]))
    return np.concatenate(idx, 1).astype(np.int32), np.concatenate(wts, 1).astype(np.float32)


def _rope_angles(vspec: Qwen3VisionSpec, grid: Grid) -> np.ndarray:
    """2-D RoPE angles float32 [Np, Hv/2]: (row frequencies ‖ col frequencies), each Hv/4 wide."""
    dim = vspec.head_dim // 2
    inv_freq = np.float32(1.0) / (np.float32(vspec.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    m, out = vspec.spatial_merge_size, []
    for t, h, w in grid:
        order = _window_order(t, h, w, m)
        rows, cols = (order % (h * w)) // w, order % w
        out.append(np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=1).astype(np.float32))
    return np.concatenate(out, 0)


def _segments(grid: Grid) -> np.ndarray:
    """int [Np]: attention segment of each patch (one per frame of each image)."""
    sizes = [h * w for t, h, w in grid for _ in range(t)]
    return np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)


def patchify(image: np.ndarray, vspec: Qwen3VisionSpec, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)):
    """One uint8 image [H, W, C] -> (pixel_values float32 [Np, Pd], grid (1, H/P, W/P)), as HF's processor.

    Rescales by 1/255, normalises by mean/std, repeats the frame to fill the temporal patch and
    flattens each patch in (C, Tp, P, P) order, patches in merge-window order. No resizing: H and
    W must be multiples of P * m (32 px for Qwen3-VL).
    """
    image = np.asarray(image)
    p, m, tp, c = vspec.patch_size, vspec.spatial_merge_size, vspec.temporal_patch_size, vspec.in_channels
    if image.ndim != 3 or image.shape[-1] != c or image.shape[0] % (p * m) or image.shape[1] % (p * m):
        raise ValueError(f"image must be [H, W, {c}] with H, W multiples of {p * m} px, got {image.shape}; resize it first")
    x = (image.astype(np.float32) * np.float32(1 / 255) - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    frames = np.repeat(x.transpose(2, 0, 1)[None], tp, axis=0)  # [Tp, C, H, W]
    gh, gw = image.shape[0] // p, image.shape[1] // p
    x = frames.reshape(tp, c, gh // m, m, p, gw // m, m, p).transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return np.ascontiguousarray(x.reshape(gh * gw, vspec.patch_dim)), (1, gh, gw)


# --------------------------------------------------------------------------------------------------
# The encoder


def _block(vspec: Qwen3VisionSpec, lp: VisionBlocks, x, sin, cos, mask) -> jax.Array:
    h = layer_norm(x, lp.ln1, vspec.norm_eps)
    # Local einsum letters: n the Np patches, h the Nv heads, d the head dim Hv.
    q, k, v = jnp.einsum("nW,W3hd->3nhd", h, lp.qkv.kernel.astype(h.dtype)) + lp.qkv.bias.astype(h.dtype)[:, None]
    q = apply_rope(q[None], sin, cos) * jnp.asarray(vspec.head_dim ** -0.5, q.dtype)
    k = apply_rope(k[None], sin, cos)
    a = attention(q, k, v[None], mask)[0]
    x = x + jnp.einsum("nhd,hdW->nW", a, lp.out.kernel.astype(a.dtype)) + lp.out.bias.astype(a.dtype)
    h = layer_norm(x, lp.ln2, vspec.norm_eps)
    return x + dense(lp.fc2, jax.nn.gelu(dense(lp.fc1, h), approximate=True))


def _merge(vspec: Qwen3VisionSpec, merger: Merger, x: jax.Array, norm_after_concat: bool) -> jax.Array:
    mw = vspec.merge_width
    if norm_after_concat:
        x = layer_norm(x.reshape(-1, mw), merger.norm, vspec.norm_eps)
    else:
        x = layer_norm(x, merger.norm, vspec.norm_eps).reshape(-1, mw)
    return dense(merger.fc2, jax.nn.gelu(dense(merger.fc1, x), approximate=False))


def encode(vspec: Qwen3VisionSpec, vision: Vision, pixel_values: jax.Array, grid_thw: Grid) -> dict[str, jax.Array]:
    """Runs the ViT, the merger and the DeepStack mergers over all images at once.

    Args:
      pixel_values: [Np, Pd] flattened patches of every image (`patchify`), in the activation dtype.
      grid_thw: static per-image (t, h, w) patch grids (`as_grid`).
    Returns:
      dict: `vit` [Np, W] the last block's output, `tokens` [Ni, D] the LLM image embeddings,
      `deepstack` [Ed, Ni, D] (Ed may be 0).
    """
    grid = as_grid(grid_thw)
    _check_grid(vspec, grid)
    n = sum(t * h * w for t, h, w in grid)
    if pixel_values.shape != (n, vspec.patch_dim):
        raise ValueError(f"pixel_values must be [Np, Pd] = {(n, vspec.patch_dim)} for grids {grid}, got {pixel_values.shape}")
    x = dense(vision.patch, pixel_values)
    idx, wts = _pos_interp(vspec, grid)
    corners = vision.pos_embed[jnp.asarray(idx)].astype(jnp.float32) * jnp.asarray(wts)[..., None]  # [4, Np, W]
    x = x + (corners[0] + corners[1] + corners[2] + corners[3]).astype(x.dtype)
    radians = jnp.asarray(_rope_angles(vspec, grid))[None, :, None, :]  # [1, Np, 1, Hv/2]
    sin, cos = jnp.sin(radians), jnp.cos(radians)
    seg = _segments(grid)
    mask = jnp.asarray(seg[:, None] == seg[None, :])[None]

    ds_layers = jnp.asarray(vspec.deepstack_layers, jnp.int32)
    feats = jnp.zeros((len(vspec.deepstack_layers),) + x.shape, x.dtype)

    def body(carry, lp, _, layer):
        x, feats = carry
        x = _block(vspec, lp, x, sin, cos, mask)
        feats = jnp.where((ds_layers == layer)[:, None, None], x[None], feats)
        return (x, feats), None

    (x, feats), _ = scan_layers(body, (x, feats), vision.blocks)
    tokens = _merge(vspec, vision.merger, x, norm_after_concat=False)
    deepstack = [_merge(vspec, jax.tree.map(lambda a, j=j: a[j], vision.deepstack), feats[j], norm_after_concat=True)
                 for j in range(len(vspec.deepstack_layers))]
    deepstack = jnp.stack(deepstack) if deepstack else jnp.zeros((0,) + tokens.shape, tokens.dtype)
    return dict(vit=x, tokens=tokens, deepstack=deepstack)


# --------------------------------------------------------------------------------------------------
# Into the language model


def _image_gather(input_ids: jax.Array, image_token_id: int, num_tokens: int):
    """(is_image bool [B, T], index int [B, T] of each image token among all of them, row-major)."""
    is_image = input_ids == image_token_id
    order = jnp.cumsum(is_image.reshape(-1).astype(jnp.int32)).reshape(is_image.shape) - 1
    if not isinstance(input_ids, jax.core.Tracer):
        count = int(np.sum(np.asarray(is_image)))
        if count != num_tokens:
            raise ValueError(f"the prompt has {count} image tokens (id {image_token_id}) but the images give {num_tokens}")
    return is_image, jnp.clip(order, 0, max(num_tokens - 1, 0))


def embed_multimodal(spec: BackboneSpec, decoder: Decoder, input_ids: jax.Array, image_tokens: jax.Array,
                     image_token_id: int) -> tuple[jax.Array, jax.Array]:
    """Text embeddings with the image tokens written, in order, over the image placeholder ids.

    Args:
      input_ids: int [B, T]; image_tokens: [Ni, D] (`encode(...)["tokens"]`, images in row order).
    Returns:
      (x [B, T, D], image_mask bool [B, T]).
    """
    x = backbone.embed_tokens(spec, decoder, input_ids)
    is_image, order = _image_gather(input_ids, image_token_id, image_tokens.shape[0])
    return jnp.where(is_image[..., None], image_tokens[order].astype(x.dtype), x), is_image


def scatter_deepstack(features: jax.Array, image_mask: jax.Array) -> jax.Array:
    """DeepStack features [Ed, Ni, D] -> residual additions [Ed, B, T, D] (zero off-image)."""
    order = jnp.clip(jnp.cumsum(image_mask.reshape(-1).astype(jnp.int32)).reshape(image_mask.shape) - 1, 0,
                     max(features.shape[1] - 1, 0))
    return jnp.where(image_mask[None, ..., None], features[:, order], jnp.zeros((), features.dtype))


def mrope_positions(input_ids, attention_mask, grid_thw, *, image_token_id: int, spatial_merge_size: int):
    """M-RoPE positions of a left- or right-padded batch (host numpy, like HF's `get_rope_index`).

    Images are taken from `grid_thw` in order, row by row; an image occupies t * (h/m) * (w/m)
    consecutive image tokens. Padding gets position 0.

    Example (m = 2, one 4 x 4-patch image, so 2 x 2 tokens; `I` = image token):
      tokens  a  b  <s> I  I  I  I  <e> c
      t       0  1  2   3  3  3  3  5   6
      h       0  1  2   3  3  4  4  5   6
      w       0  1  2   3  4  3  4  5   6

    Returns:
      (positions int32 [3, B, T], next_position int32 [B] = max position + 1, where decoding continues).
    """
    ids, am = np.asarray(input_ids), np.asarray(attention_mask).astype(bool)
    grids = list(as_grid(grid_thw)) if grid_thw is not None and np.size(grid_thw) else []
    m = spatial_merge_size
    b, t = ids.shape
    pos = np.zeros((3, b, t), np.int32)
    nxt = np.zeros((b,), np.int32)
    g = 0
    for r in range(b):
        real = np.flatnonzero(am[r])
        row = ids[r, real]
        out = np.zeros((3, row.size), np.int64)
        i = cur = 0
        while i < row.size:
            if row[i] != image_token_id:
                out[:, i] = cur
                cur, i = cur + 1, i + 1
                continue
            if g >= len(grids):
                raise ValueError(f"row {r} has more images than the {len(grids)} grids given")
            gt, gh, gw = grids[g][0], grids[g][1] // m, grids[g][2] // m
            n = gt * gh * gw
            if row.size < i + n or np.any(row[i:i + n] != image_token_id):
                raise ValueError(f"row {r}: image {g} with grid {grids[g]} needs {n} consecutive image tokens at {i}")
            tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
            out[:, i:i + n] = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + cur
            cur, i, g = int(out[:, i:i + n].max()) + 1, i + n, g + 1
        pos[:, r, real] = out
        nxt[r] = cur
    if g != len(grids):
        raise ValueError(f"{len(grids)} image grids given but the prompts hold {g} images")
    return pos, nxt


def decode_positions(next_position, num_steps: int) -> np.ndarray:
    """int32 [B, num_steps]: M-RoPE position of decode step j = max prefix position + 1 + j (all axes)."""
    return (np.asarray(next_position, np.int32)[:, None] + np.arange(num_steps, dtype=np.int32)[None]).astype(np.int32)


def image_token_count(grid_thw, spatial_merge_size: int) -> list[int]:
    """LLM tokens per image: t * h * w / m²."""
    return [t * h * w // spatial_merge_size ** 2 for t, h, w in as_grid(grid_thw)]
