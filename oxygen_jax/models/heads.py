"""Flow-matching action heads that read one shared VLM prefix: three kinds, their parameters and presets.

A head is a small transformer (a DiT) that turns noise into an action chunk in `num_steps` Euler
steps, conditioned on what one backbone prefix pass left behind (`PrefixOutputs`). The three
kinds differ only in what they read and how:

| kind           | reads from the prefix                         | per-frame precompute (`prepare`)     | model       |
|----------------|-----------------------------------------------|--------------------------------------|-------------|
| `joint_kv`     | post-RoPE K/V of some backbone layers (XR0:   | slice those layers, RoPE tables of   | XR0         |
|                | last 16 of 36), prefix mask, next position    | the head tokens, masks               |             |
| `cross_hidden` | one hidden state per cross block (HF          | LayerNorm + Linear per layer         | StarVLA     |
|                | `hidden_states` indices)                      | (optional), every cross block's K/V  | QwenPI_v3   |
| `cross_last`   | the final-normed hidden state only            | every cross block's K/V              | QwenGR00T   |

Per frame: `state = prepare(head_params, spec, prefix)` once, then
`actions = denoise(head_params, spec, state, noise)`, a `fori_loop` over a static step count that
reads `state` and never recomputes it: the cross-attention K/V of a cross head are computed once
per frame, never per denoise step.

Blocks (what the public code of each model does; see the preset docstrings for sources and doubts):

* joint (XR0): `x = x + g1 * Attn(mod(RMS(x)))`, `x = RMS(x)`, `x = x + g2 * SwiGLU(mod(RMS(x)))`,
  `x = RMS(x)`; q/k RMSNorm over H, RoPE continuing after the prefix, keys = [prefix K of the
  mapped backbone layer ‖ own K]; (shift, scale, gate) x 2 = per-layer table [6, Da] + a shared
  projection of the time embedding (adaLN-single).
* cross / self (diffusers `BasicTransformerBlock` as GR00T and StarVLA use it):
  `x = x + Attn(LN(x) * (1 + scale) + shift)` (K/V from the context, or from the same tokens in a
  self block), `x = x + FF(LN(x))`, GELU-tanh FF with biases, LayerNorms without affine weights,
  (scale, shift) from `Linear(silu(temb))` per block; no RoPE, a learned position embedding on
  the action tokens instead.

Axes (`oxygen_jax.axes`): B batch, P prefix tokens, T head tokens (extra tokens + Ha actions), S
keys (P + T for joint attention), L layers (Lk prefix layers whose K/V are kept, Lh hidden states
kept, Lc cross blocks), Da head width, D VLM width, F head MLP, N heads, K KV heads, H head dim,
Ha horizon, Ad action dim, Ds state dim. New here:
    Dx   width of the context a cross block reads (D, or the per-layer projection width)
    Dt   width of the sinusoidal time features (256)
    Do   width of a DiT's output projection before the action decoder (GR00T; none in QwenPI_v3)
    Fo   hidden width of the state encoder / action decoder MLPs of cross heads
    Ne   extra tokens before the actions (sink, state, future tokens)
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Literal

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone as bb
from oxygen_jax.models.backbone import BackboneSpec, RopeSpec
from oxygen_jax.nn.layers import LayerNorm, Unstacked, scan_layers

Kind = Literal["joint_kv", "cross_hidden", "cross_last"]
_EXTRA = {"joint_kv": ("sink", "state"), "cross_hidden": ("state", "future"), "cross_last": ("state", "future")}


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# --------------------------------------------------------------------------------------------------
# Spec


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadSpec:
    """One action head: what it reads from the prefix, its dims, its flow. Hashable and static.

    Checked on its own in `__post_init__` and against a backbone by `check_backbone` (called when a
    `mot.ModelSpec` is built).
    """

    name: str  # key of the head in a model and in `sample_all`'s outputs
    kind: Kind
    width: int  # Da
    depth: int  # blocks (joint layers, or cross + self blocks)
    num_heads: int  # N
    num_kv_heads: int  # K: joint_kv must equal the backbone's (its K/V are concatenated); cross: = N
    head_dim: int  # H: joint_kv must equal the backbone's
    mlp_dim: int  # F (SwiGLU for joint, GELU-tanh for cross)
    action_dim: int  # Ad
    horizon: int  # Ha
    num_steps: int  # Euler steps (static)
    t_direction: Literal["0_to_1", "1_to_0"]  # 0_to_1: t = 0 noise -> 1 actions (XR0, StarVLA); 1_to_0: π0.5
    time_cond: Literal["adaln_table", "adaln_scale_shift"]  # XR0's adaLN-single / diffusers' AdaLayerNorm
    time_input: Literal["continuous", "bucket"]  # the network sees t * time_scale, or floor(t * time_scale)
    time_scale: int = 1000
    time_embed_dim: int = 256  # Dt
    kv_layers: tuple[int, ...] = ()  # joint_kv: backbone layer read by each head layer
    hidden_layers: tuple[int, ...] = ()  # cross: HF hidden_states index read by each cross block
    #   (0 = embeddings, l = output of layer l-1 before DeepStack, L = final-normed output)
    vlm_width: int = 0  # cross: D of the hidden states read
    hidden_proj: int | None = None  # cross: LayerNorm + Linear(D -> this) per read layer (QwenPI_v3)
    block_pattern: Literal["joint", "all_cross", "cross_self"] = "joint"
    extra_tokens: tuple[str, ...] = ()  # in order before the actions: joint "sink", "state"; cross "state", "future"
    num_future_tokens: int = 0
    state_dim: int = 0  # Ds of the state token's encoder (0: no state token)
    positions: Literal["continue_rope", "learned"] = "continue_rope"
    max_positions: int = 0  # learned: rows of the position table
    suffix_mask: Literal["causal", "bidirectional"] = "causal"  # joint: attention among head tokens
    suffix_window: int | None = None  # joint: action j also sees only actions j - window .. j
    action_position_offset: int = 0  # joint: RoPE gap between the extra tokens and the actions
    dit_output_dim: int | None = None  # cross: adaLN output block + Linear(Da -> Do) before the decoder
    io_hidden: int = 0  # cross: Fo

    def __post_init__(self):
        name = f"HeadSpec {self.name!r}"
        _require(bool(self.name), "HeadSpec.name must be a non-empty string")
        _require(self.kind in _EXTRA, f"{name}: kind must be 'joint_kv', 'cross_hidden' or 'cross_last', got {self.kind!r}")
        for f in ("width", "depth", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "action_dim", "horizon",
                  "num_steps", "time_scale", "time_embed_dim"):
            _require(getattr(self, f) > 0, f"{name}: {f} must be positive, got {getattr(self, f)}")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"{name}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        _require(self.time_embed_dim % 2 == 0 and self.width % 2 == 0, f"{name}: time_embed_dim and width must be even")
        _require(self.t_direction in ("0_to_1", "1_to_0"), f"{name}: t_direction must be '0_to_1' or '1_to_0', got {self.t_direction!r}")
        _require(self.time_input in ("continuous", "bucket"), f"{name}: time_input must be 'continuous' or 'bucket', got {self.time_input!r}")
        bad = [t for t in self.extra_tokens if t not in _EXTRA[self.kind]]
        _require(not bad and len(set(self.extra_tokens)) == len(self.extra_tokens),
                 f"{name}: extra_tokens of a {self.kind} head are distinct names from {_EXTRA[self.kind]}, got {self.extra_tokens}")
        _require(("state" in self.extra_tokens) == (self.state_dim > 0),
                 f"{name}: a 'state' extra token needs state_dim > 0 and state_dim > 0 needs the token "
                 f"(got extra_tokens={self.extra_tokens}, state_dim={self.state_dim})")
        if self.kind == "joint_kv":
            self._check_joint(name)
        else:
            self._check_cross(name)

    def _check_joint(self, name: str) -> None:
        _require(self.block_pattern == "joint", f"{name}: a joint_kv head has block_pattern='joint', got {self.block_pattern!r}")
        _require(self.time_cond == "adaln_table", f"{name}: joint_kv heads implement time_cond='adaln_table' only")
        _require(self.positions == "continue_rope", f"{name}: joint_kv heads continue the prefix RoPE (positions='continue_rope')")
        _require(self.head_dim % 2 == 0, f"{name}: head_dim must be even for RoPE, got {self.head_dim}")
        _require(len(self.kv_layers) == self.depth,
                 f"{name}: kv_layers must name one backbone layer per head layer ({self.depth}), got {len(self.kv_layers)}")
        _require(not self.hidden_layers and self.hidden_proj is None and self.dit_output_dim is None,
                 f"{name}: hidden_layers / hidden_proj / dit_output_dim belong to cross heads")
        _require(self.suffix_mask in ("causal", "bidirectional"), f"{name}: suffix_mask must be 'causal' or 'bidirectional'")
        _require(self.suffix_window is None or self.suffix_window >= 0, f"{name}: suffix_window must be None or >= 0")
        _require(self.action_position_offset >= 0, f"{name}: action_position_offset must be >= 0")
        _require(self.num_future_tokens == 0, f"{name}: future tokens belong to cross heads")

    def _check_cross(self, name: str) -> None:
        _require(self.block_pattern in ("all_cross", "cross_self"),
                 f"{name}: a {self.kind} head has block_pattern 'all_cross' or 'cross_self', got {self.block_pattern!r}")
        _require(self.block_pattern == "all_cross" or self.depth % 2 == 0,
                 f"{name}: block_pattern='cross_self' alternates cross and self blocks, so depth must be even, got {self.depth}")
        _require(self.time_cond == "adaln_scale_shift", f"{name}: cross heads implement time_cond='adaln_scale_shift' only")
        _require(self.positions == "learned" and self.max_positions >= self.horizon,
                 f"{name}: cross heads add a learned position table (positions='learned') with max_positions >= horizon")
        _require(self.num_kv_heads == self.num_heads, f"{name}: cross heads use multi-head attention (num_kv_heads = num_heads)")
        _require(self.vlm_width > 0 and self.io_hidden > 0, f"{name}: cross heads need vlm_width and io_hidden > 0")
        _require(not self.kv_layers, f"{name}: kv_layers belong to joint_kv heads")
        _require(len(self.hidden_layers) == self.num_cross_blocks,
                 f"{name}: hidden_layers must name one hidden state per cross block ({self.num_cross_blocks}), got {len(self.hidden_layers)}")
        if self.kind == "cross_last":
            _require(len(set(self.hidden_layers)) == 1,
                     f"{name}: a cross_last head reads one hidden state (the last) in every cross block, got {self.hidden_layers}")
        _require(("future" in self.extra_tokens) == (self.num_future_tokens > 0),
                 f"{name}: a 'future' extra token needs num_future_tokens > 0 and the converse")
        _require(self.suffix_window is None and self.action_position_offset == 0,
                 f"{name}: suffix_window / action_position_offset belong to joint_kv heads")

    @property
    def num_cross_blocks(self) -> int:
        """Lc: blocks that read the prefix (cross_self: the even blocks)."""
        if self.kind == "joint_kv":
            return 0
        return self.depth if self.block_pattern == "all_cross" else self.depth // 2

    @property
    def context_width(self) -> int:
        """Dx: width of what a cross block's K/V projection reads."""
        return self.hidden_proj or self.vlm_width

    @property
    def num_extra(self) -> int:
        """Ne: tokens before the actions."""
        return sum(self.num_future_tokens if t == "future" else 1 for t in self.extra_tokens)

    @property
    def num_tokens(self) -> int:
        """T = Ne + Ha."""
        return self.num_extra + self.horizon

    def check_backbone(self, spec: BackboneSpec) -> None:
        """Raises ValueError naming the field when this head cannot read `spec`'s prefix."""
        name = f"head {self.name!r}"
        if self.kind == "joint_kv":
            _require(self.head_dim == spec.head_dim,
                     f"{name}: head_dim {self.head_dim} must equal the backbone's {spec.head_dim} (it attends to the backbone's K/V)")
            _require(self.num_kv_heads == spec.num_kv_heads,
                     f"{name}: num_kv_heads {self.num_kv_heads} must equal the backbone's {spec.num_kv_heads} (its K/V are concatenated to the backbone's)")
            _require(all(0 <= l < spec.depth for l in self.kv_layers),
                     f"{name}: kv_layers {self.kv_layers} must be backbone layers in [0, {spec.depth})")
        else:
            _require(self.vlm_width == spec.width, f"{name}: vlm_width {self.vlm_width} must equal the backbone width {spec.width}")
            _require(all(0 <= l <= spec.depth for l in self.hidden_layers),
                     f"{name}: hidden_layers {self.hidden_layers} must be HF hidden_states indices in [0, {spec.depth}]")
            if self.kind == "cross_last":
                _require(self.hidden_layers[0] == spec.depth,
                         f"{name}: a cross_last head reads hidden_states[{spec.depth}] (the final-normed output), got {self.hidden_layers[0]}")

    def replace(self, **changes) -> HeadSpec:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# Parameters


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class Linear:
    """An affine map; the kernel keeps named axes split (e.g. [Da, N, H]) for einsum."""

    kernel: jax.Array  # [(L,) in..., out...]
    bias: jax.Array | None = None  # [(L,) out...]


@_pytree
class Mlp:
    """Two Linear layers with the head's activation between (gelu-tanh for joint, relu for cross)."""

    fc1: Linear  # [in, hidden]
    fc2: Linear  # [hidden, out]


@_pytree
class JointLayers:
    """XR0 DiT layers, stacked on a leading L axis."""

    q: Linear  # kernel [L, Da, N, H], bias [L, N, H]
    kv: Linear  # kernel [L, 2, Da, K, H], bias [L, 2, K, H]; index 0 = K, 1 = V
    out: jax.Array  # [L, N, H, Da] (no bias)
    q_norm: jax.Array  # [L, H] RMSNorm scale (plain w)
    k_norm: jax.Array  # [L, H]
    norms: jax.Array  # [L, 4, Da]: before attention, after it, before the MLP, after it
    gating: jax.Array  # [L, 2, Da, F]; index 0 = gate (silu), 1 = up
    linear: jax.Array  # [L, F, Da]
    adaln: jax.Array  # [L, 6, Da]: (shift, scale, gate) for attention, then for the MLP


@_pytree
class JointHead:
    time_mlp: Mlp  # [Dt, Da], [Da, Da], no biases (silu between)
    time_proj: Linear  # kernel [Da, 6, Da], bias [6, Da]: shared by every layer
    sink: jax.Array | None  # [1, Da]
    state_in: Mlp | None  # [Ds, Da], [Da, Da], no biases
    action_in: Mlp  # [Ad, Da], [Da, Da], no biases
    action_out: Mlp  # [Da, Ad], [Ad, Ad], no biases
    layers: JointLayers | Unstacked


@_pytree
class CrossBlocks:
    """diffusers-style DiT blocks, stacked on a leading L axis (cross blocks read Dx, self blocks Da)."""

    ada: Linear  # kernel [L, Da, 2, Da], bias [L, 2, Da]: (scale, shift) of the pre-attention LayerNorm
    q: Linear  # kernel [L, Da, N, H], bias [L, N, H]
    kv: Linear  # kernel [L, 2, Dx, N, H], bias [L, 2, N, H]
    out: Linear  # kernel [L, N, H, Da], bias [L, Da]
    ff_in: Linear  # [L, Da, F], [L, F]
    ff_out: Linear  # [L, F, Da], [L, Da]


@_pytree
class BlockPair:
    """One cross block followed by one self block (block_pattern='cross_self')."""

    cross: CrossBlocks
    self_: CrossBlocks


@_pytree
class HiddenProj:
    """QwenPI_v3's per-layer projection of the hidden states: LayerNorm then Linear(D -> Dx)."""

    norm: LayerNorm  # [Lc, D]
    proj: Linear  # kernel [Lc, D, Dx], bias [Lc, Dx]


@_pytree
class ActionEncoder:
    """GR00T's action encoder: w3(swish(w2([w1(a) ‖ sincos(t)]))) per action token."""

    w1: Linear  # [Ad, Da]
    w2: Linear  # [2 Da, Da]
    w3: Linear  # [Da, Da]


@_pytree
class CrossHead:
    hidden_proj: HiddenProj | None
    time_mlp: Mlp  # [Dt, Da], [Da, Da], with biases (silu between)
    action_in: ActionEncoder
    positions: jax.Array  # [max_positions, Da]
    future: jax.Array | None  # [Nf, Da]
    state_in: Mlp | None  # [Ds, Fo], [Fo, Da] (relu)
    blocks: CrossBlocks | BlockPair | Unstacked  # leading Lc
    out_mod: Linear | None  # kernel [Da, 2, Da], bias [2, Da]: (shift, scale) of the output LayerNorm
    out_proj: Linear | None  # [Da, Do]
    action_out: Mlp  # [Da or Do, Fo], [Fo, Ad] (relu)


HeadParams = JointHead | CrossHead


def head_tree(spec: HeadSpec, draw: bb.Draw) -> HeadParams:
    """The parameters of `spec` with every leaf from `draw` (see `backbone.decoder_tree`): the one
    description of their shapes. Random values are fan-in scaled; norm scales sit around 1."""
    da, n, k, h, f, ad = spec.width, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.mlp_dim, spec.action_dim

    def lin(in_shape, out_shape, lead=(), bias=True):
        fan_in = math.prod(in_shape)
        return Linear(kernel=draw(lead + in_shape + out_shape, 1.0 / math.sqrt(fan_in), 0.0),
                      bias=draw(lead + out_shape, 0.1, 0.0) if bias else None)

    def mlp(i, hid, o, bias):
        return Mlp(fc1=lin((i,), (hid,), bias=bias), fc2=lin((hid,), (o,), bias=bias))

    if spec.kind == "joint_kv":
        L = spec.depth
        kv = lin((da,), (k, h), lead=(L, 2))
        layers = JointLayers(
            q=lin((da,), (n, h), lead=(L,)), kv=kv, out=draw((L, n, h, da), 1.0 / math.sqrt(n * h), 0.0),
            q_norm=draw((L, h), 0.1, 1.0), k_norm=draw((L, h), 0.1, 1.0), norms=draw((L, 4, da), 0.1, 1.0),
            gating=draw((L, 2, da, f), 1.0 / math.sqrt(da), 0.0), linear=draw((L, f, da), 1.0 / math.sqrt(f), 0.0),
            adaln=draw((L, 6, da), 1.0 / math.sqrt(da), 0.0),
        )
        return JointHead(
            time_mlp=mlp(spec.time_embed_dim, da, da, bias=False), time_proj=lin((da,), (6, da)),
            sink=draw((1, da), 1.0, 0.0) if "sink" in spec.extra_tokens else None,
            state_in=mlp(spec.state_dim, da, da, bias=False) if spec.state_dim else None,
            action_in=mlp(ad, da, da, bias=False), action_out=mlp(da, ad, ad, bias=False), layers=layers,
        )

    def blocks(lc, ctx):
        return CrossBlocks(
            ada=lin((da,), (2, da), lead=(lc,)), q=lin((da,), (n, h), lead=(lc,)), kv=lin((ctx,), (n, h), lead=(lc, 2)),
            out=lin((n, h), (da,), lead=(lc,)), ff_in=lin((da,), (f,), lead=(lc,)), ff_out=lin((f,), (da,), lead=(lc,)),
        )

    lc, dx, fo = spec.num_cross_blocks, spec.context_width, spec.io_hidden
    stack = blocks(lc, dx) if spec.block_pattern == "all_cross" else BlockPair(cross=blocks(lc, dx), self_=blocks(lc, da))
    proj = None
    if spec.hidden_proj:
        proj = HiddenProj(norm=LayerNorm(scale=draw((lc, spec.vlm_width), 0.1, 1.0), bias=draw((lc, spec.vlm_width), 0.1, 0.0)),
                          proj=lin((spec.vlm_width,), (dx,), lead=(lc,)))
    do = spec.dit_output_dim
    return CrossHead(
        hidden_proj=proj, time_mlp=mlp(spec.time_embed_dim, da, da, bias=True),
        action_in=ActionEncoder(w1=lin((ad,), (da,)), w2=lin((2 * da,), (da,)), w3=lin((da,), (da,))),
        positions=draw((spec.max_positions, da), 0.02, 0.0),
        future=draw((spec.num_future_tokens, da), 0.02, 0.0) if spec.num_future_tokens else None,
        state_in=mlp(spec.state_dim, fo, da, bias=True) if spec.state_dim else None, blocks=stack,
        out_mod=lin((da,), (2, da)) if do else None, out_proj=lin((da,), (do,)) if do else None,
        action_out=mlp(do or da, fo, ad, bias=True),
    )


def init_head(spec: HeadSpec, seed: int = 0, dtype: str = "float32") -> HeadParams:
    """Random weights (tests and benchmarks). Seeded by (seed, name): a head's weights do not
    depend on which other heads share its model."""
    return head_tree(spec, bb.numpy_draws((int(seed) << 32) | zlib.crc32(spec.name.encode()), dtype))


def abstract_head(spec: HeadSpec, dtype: str = "float32") -> HeadParams:
    """`jax.ShapeDtypeStruct` leaves via `jax.eval_shape`: nothing is allocated."""
    return jax.eval_shape(lambda: head_tree(spec, bb.zeros_draws(dtype)))


def param_count(tree) -> int:
    """Number of scalars in a (possibly abstract) parameter tree."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def unstack_head(params: HeadParams) -> HeadParams:
    """The per-step layer stack as `params.Unstacked` (the fast form on XLA's CPU backend)."""
    if isinstance(params, JointHead):
        return dataclasses.replace(params, layers=bb.unstack_layers(params.layers))
    return dataclasses.replace(params, blocks=bb.unstack_layers(params.blocks))


def stack_head(params: HeadParams) -> HeadParams:
    """Inverse of `unstack_head`."""
    if isinstance(params, JointHead):
        return dataclasses.replace(params, layers=bb.stack_layers(params.layers))
    return dataclasses.replace(params, blocks=bb.stack_layers(params.blocks))


def _check_params(spec: HeadSpec, params: HeadParams) -> None:
    want = JointHead if spec.kind == "joint_kv" else CrossHead
    if not isinstance(params, want):
        raise ValueError(f"head {spec.name!r} is {spec.kind} and needs {want.__name__} weights, got {type(params).__name__}")


# --------------------------------------------------------------------------------------------------
# What the prefix pass hands to the heads


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixOutputs:
    """Everything heads and the language decoder read from one prefix pass (`mot.prefix_pass`).

    Attributes:
      k, v: [Lk, B, P, K, H] K/V (post q/k-norm and RoPE) of the backbone layers `kv_layers`, in
        that order; None when nobody reads K/V.
      hidden: [Lh, B, P, D] HF-convention hidden states `hidden_layers` (0 = embeddings, l = output
        of layer l - 1 before any DeepStack addition, L = final-normed output); None when unread.
      mask: bool [B, P] valid prefix tokens.
      next_position: int32 [B] max prefix position + 1: where head tokens and decoded text continue.
      last_hidden: [B, D] final-normed output at the last valid token (the language decoder's first
        logits); None without a language decoder.
      kv_layers, hidden_layers: static, sorted backbone layer / HF hidden-state indices kept.
      rope: static, the backbone's rotary embedding (joint heads continue it).

    Example: a model with an XR0-style head reading layers 20..35 and a language decoder keeps
    kv_layers = (0, ..., 35); without the decoder it keeps (20, ..., 35) only.
    """

    k: jax.Array | None
    v: jax.Array | None
    hidden: jax.Array | None
    mask: jax.Array
    next_position: jax.Array
    last_hidden: jax.Array | None
    kv_layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    hidden_layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    rope: RopeSpec = dataclasses.field(metadata=dict(static=True))

    @property
    def length(self) -> int:
        """P: prefix positions."""
        return self.mask.shape[-1]

    def layer_kv(self, layers: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
        """K, V [len(layers), B, P, K, H] of the given backbone layers (a slice when contiguous)."""
        missing = [l for l in layers if l not in self.kv_layers]
        if missing or self.k is None:
            raise ValueError(f"the prefix kept the K/V of layers {self.kv_layers}, not {tuple(missing) or layers}; "
                             "build it with a ModelSpec that contains this head")
        rows = tuple(self.kv_layers.index(l) for l in layers)
        return select_layers(self.k, rows), select_layers(self.v, rows)

    def hidden_states(self, layers: tuple[int, ...]) -> jax.Array:
        """[len(layers), B, P, D] hidden states of the given HF indices."""
        missing = [l for l in layers if l not in self.hidden_layers]
        if missing or self.hidden is None:
            raise ValueError(f"the prefix kept hidden states {self.hidden_layers}, not {tuple(missing) or layers}; "
                             "build it with a ModelSpec that contains this head")
        return select_layers(self.hidden, tuple(self.hidden_layers.index(l) for l in layers))


def select_layers(x: jax.Array, rows: tuple[int, ...]) -> jax.Array:
    """x[rows] along the leading (layer) axis: a slice when the rows are contiguous, else a gather."""
    if rows == tuple(range(rows[0], rows[0] + len(rows))):
        return jax.lax.slice_in_dim(x, rows[0], rows[0] + len(rows), axis=0)
    return jnp.take(x, jnp.asarray(rows, jnp.int32), axis=0)


# --------------------------------------------------------------------------------------------------
# Pieces


def _dtype(params: HeadParams):
    return params.action_out.fc1.kernel.dtype


def _lin(eq: str, x: jax.Array, p: Linear) -> jax.Array:
    y = jnp.einsum(eq, x, p.kernel.astype(x.dtype))
    return y if p.bias is None else y + p.bias.astype(y.dtype)


def _mlp(p: Mlp, x: jax.Array, act) -> jax.Array:
    return _lin("...i,io->...o", act(_lin("...i,io->...o", x, p.fc1)), p.fc2)


_gelu = lambda x: jax.nn.gelu(x, approximate=True)  # noqa: E731


def _rms(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Qwen's RMSNorm: normalise in float32, cast back, multiply by w."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)).astype(x.dtype)
    return normed * scale.astype(x.dtype)


def _layer_norm(x: jax.Array, eps: float, ln: LayerNorm | None = None) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, -1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), -1, keepdims=True) + eps)
    if ln is not None:
        y = y * ln.scale.astype(jnp.float32) + ln.bias.astype(jnp.float32)
    return y.astype(x.dtype)


def sinusoid(t: jax.Array, dim: int, *, cos_first: bool, freq_shift: int = 0) -> jax.Array:
    """float32 [..., dim] features of t [...]: frequencies exp(-ln(1e4) i / (dim/2 - freq_shift)).

    `cos_first, freq_shift=0` is XR0's timestep embedding; `cos_first, freq_shift=1` is diffusers'
    `Timesteps(flip_sin_to_cos=True, downscale_freq_shift=1)` (GR00T's DiT); `sin first, 0` is
    GR00T's action encoder.
    """
    half = dim // 2
    freqs = jnp.exp(-math.log(10_000.0) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift))
    args = t.astype(jnp.float32)[..., None] * freqs
    parts = [jnp.cos(args), jnp.sin(args)] if cos_first else [jnp.sin(args), jnp.cos(args)]
    return jnp.concatenate(parts, axis=-1)


def _time(spec: HeadSpec, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(t float32 [], the network's time input float32 []) at Euler step `step` (int32, traced).

    0_to_1: t = step / S; 1_to_0: t = 1 - step / S. A bucketed input is floor(t * scale) computed
    in integers, so S = 5 gives exactly 0, 200, 400, 600, 800.
    """
    s = spec.num_steps
    num = step if spec.t_direction == "0_to_1" else s - step
    t = num.astype(jnp.float32) / s
    if spec.time_input == "bucket":
        return t, ((num * spec.time_scale) // s).astype(jnp.float32)
    return t, t * spec.time_scale


def _suffix_mask(spec: HeadSpec) -> jax.Array:
    """bool [T, T] among the head's own tokens (joint heads).

    causal: token i sees tokens <= i; with `suffix_window` w, action j additionally sees only
    actions j - w .. j (the extra tokens stay visible). Example, 1 sink + 1 state + 3 actions,
    w = 1 (rows = queries):  s: 1 0 0 0 0 / st: 1 1 0 0 0 / a0: 1 1 1 0 0 / a1: 1 1 1 1 0 /
    a2: 1 1 0 1 1.
    """
    t, ne = spec.num_tokens, spec.num_extra
    i = jnp.arange(t)
    if spec.suffix_mask == "bidirectional":
        return jnp.ones((t, t), bool)
    mask = i[None, :] <= i[:, None]
    if spec.suffix_window is not None:
        both_actions = (i[:, None] >= ne) & (i[None, :] >= ne)
        mask &= ~both_actions | (i[:, None] - i[None, :] <= spec.suffix_window)
    return mask


# --------------------------------------------------------------------------------------------------
# Per-frame state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadState:
    """What a head reads at every denoise step; built once per frame by `prepare`, never written.

    Attributes:
      k, v: joint: [L, B, P, K, H] the mapped backbone layers' K/V; cross: [Lc, B, P, N, H] every
        cross block's K/V of its context.
      mask: bool joint: [B, T, P + T] (prefix validity ‖ suffix mask); cross: [B, T, P].
      extra: [B, Ne, Da] embedded extra tokens (constant over the steps).
      sin, cos: joint: [B, T, 1, H/2] RoPE tables of the head tokens; None for cross heads.
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    extra: jax.Array
    sin: jax.Array | None = None
    cos: jax.Array | None = None


def _extra_tokens(spec: HeadSpec, params: HeadParams, b: int, state: jax.Array | None, dtype) -> jax.Array:
    if "state" in spec.extra_tokens:
        if state is None or state.shape != (b, spec.state_dim):
            got = None if state is None else state.shape
            raise ValueError(f"head {spec.name!r} has a state token: pass its state [B, Ds] = {(b, spec.state_dim)}, got {got}")
    parts = []
    for name in spec.extra_tokens:
        if name == "sink":
            parts.append(jnp.broadcast_to(params.sink.astype(dtype)[None], (b, 1, spec.width)))
        elif name == "future":
            parts.append(jnp.broadcast_to(params.future.astype(dtype)[None], (b,) + params.future.shape))
        else:
            act = _gelu if spec.kind == "joint_kv" else jax.nn.relu
            parts.append(_mlp(params.state_in, state.astype(dtype)[:, None, :], act))
    if not parts:
        return jnp.zeros((b, 0, spec.width), dtype)
    return jnp.concatenate(parts, axis=1)


def prepare(params: HeadParams, spec: HeadSpec, prefix: PrefixOutputs, state: jax.Array | None = None) -> HeadState:
    """Once per frame: everything the head's denoise steps read from the prefix.

    Args:
      prefix: the shared prefix pass; must hold this head's reads.
      state: [B, Ds] robot state for heads with a state token (else None).
    Returns:
      `HeadState`. For cross heads this is where the per-block cross-attention K/V are computed
      (with QwenPI_v3's per-layer LayerNorm + Linear first), once, for all `num_steps` steps.
    """
    _check_params(spec, params)
    dtype = _dtype(params)
    b, p = prefix.mask.shape
    t = spec.num_tokens
    if spec.kind == "joint_kv":
        k, v = prefix.layer_kv(spec.kv_layers)
        extra = _extra_tokens(spec, params, b, state, dtype)
        pos = prefix.next_position[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        pos = pos + jnp.where(jnp.arange(t) >= spec.num_extra, spec.action_position_offset, 0)[None]
        radians = bb.rope_angles(prefix.rope, pos, spec.head_dim)[..., None, :]
        mask = jnp.concatenate([jnp.broadcast_to(prefix.mask[:, None, :], (b, t, p)),
                                jnp.broadcast_to(_suffix_mask(spec)[None], (b, t, t))], axis=-1)
        return HeadState(k=k.astype(dtype), v=v.astype(dtype), mask=mask, extra=extra,
                         sin=jnp.sin(radians), cos=jnp.cos(radians))

    reads = spec.hidden_layers if spec.kind == "cross_hidden" else spec.hidden_layers[:1]
    hidden = prefix.hidden_states(reads).astype(dtype)  # [Lc or 1, B, P, D]
    extra = _extra_tokens(spec, params, b, state, dtype)
    per_block = (hidden if spec.kind == "cross_hidden" else None, params.hidden_proj)

    def body(_, blk, extra_l, __):
        ctx = hidden[0] if extra_l[0] is None else extra_l[0]
        if extra_l[1] is not None:  # QwenPI_v3: LayerNorm + Linear(D -> Dx) of this block's layer
            ctx = _lin("BPD,DX->BPX", _layer_norm(ctx, 1e-5, extra_l[1].norm), extra_l[1].proj)
        cross = blk.cross if isinstance(blk, BlockPair) else blk
        return None, _lin("BPX,2XNH->BP2NH", ctx, cross.kv)

    _, kv = scan_layers(body, None, params.blocks, per_block)  # [Lc, B, P, 2, N, H]
    mask = jnp.broadcast_to(prefix.mask[:, None, :], (b, t, p))
    return HeadState(k=kv[:, :, :, 0], v=kv[:, :, :, 1], mask=mask, extra=extra)


# --------------------------------------------------------------------------------------------------
# Velocity and the Euler loop


def _joint_layer(spec: HeadSpec, lp: JointLayers, x, mod, ck, cv, st: HeadState) -> jax.Array:
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod + lp.adaln.astype(x.dtype)[None], 6, axis=1)  # [B, 1, Da] each
    h = _rms(x, lp.norms[0]) * (1 + scale1) + shift1
    q = _lin("BTD,DNH->BTNH", h, lp.q)
    kv = _lin("BTD,2DKH->BT2KH", h, lp.kv)  # bias [2, K, H] broadcasts over the trailing axes
    k, v = kv[:, :, 0], kv[:, :, 1]
    q = bb.apply_rope(_rms(q, lp.q_norm), st.sin, st.cos) * jnp.asarray(spec.head_dim ** -0.5, q.dtype)
    k = bb.apply_rope(_rms(k, lp.k_norm), st.sin, st.cos)
    a = bb.attention(q, jnp.concatenate([ck, k], axis=1), jnp.concatenate([cv, v], axis=1), st.mask)
    x = _rms(x + gate1 * jnp.einsum("BTNH,NHD->BTD", a, lp.out.astype(a.dtype)), lp.norms[1])
    h = _rms(x, lp.norms[2]) * (1 + scale2) + shift2
    gate, up = jnp.einsum("BTD,2DF->2BTF", h, lp.gating.astype(h.dtype))
    return _rms(x + gate2 * ((jax.nn.silu(gate) * up) @ lp.linear.astype(h.dtype)), lp.norms[3])


def _cross_block(spec: HeadSpec, blk: CrossBlocks, x, temb_act, k, v, mask) -> jax.Array:
    """One diffusers BasicTransformerBlock; k, v None means self-attention over x."""
    scale, shift = jnp.split(_lin("BD,D2E->B2E", temb_act, blk.ada), 2, axis=1)  # [B, 1, Da] each
    h = _layer_norm(x, 1e-5) * (1 + scale) + shift
    q = _lin("BTD,DNH->BTNH", h, blk.q) * jnp.asarray(spec.head_dim ** -0.5, h.dtype)
    if k is None:
        kv = _lin("BTD,2DNH->BT2NH", h, blk.kv)
        k, v = kv[:, :, 0], kv[:, :, 1]
        mask = jnp.ones((x.shape[0], x.shape[1], x.shape[1]), bool)
    x = x + _lin("BTNH,NHD->BTD", bb.attention(q, k, v, mask), blk.out)
    h = _layer_norm(x, 1e-5)
    return x + _lin("BTF,FD->BTD", _gelu(_lin("BTD,DF->BTF", h, blk.ff_in)), blk.ff_out)


def velocity(params: HeadParams, spec: HeadSpec, st: HeadState, x_t: jax.Array, step: jax.Array) -> jax.Array:
    """The head's output v(x_t, t) float32 [B, Ha, Ad] at Euler step `step` (int32)."""
    dtype = _dtype(params)
    ha = spec.horizon
    _, t_in = _time(spec, step)
    b = x_t.shape[0]
    x_t = x_t.astype(dtype)
    if spec.kind == "joint_kv":
        feats = sinusoid(jnp.broadcast_to(t_in, (b,)), spec.time_embed_dim, cos_first=True).astype(dtype)
        temb = _mlp(params.time_mlp, feats, jax.nn.silu)  # [B, Da]
        mod = _lin("BD,D6E->B6E", temb, params.time_proj)  # [B, 6, Da]: no activation before it (XR0)
        x = jnp.concatenate([st.extra, _mlp(params.action_in, x_t, _gelu)], axis=1)

        def body(x, lp, kv, _):
            return _joint_layer(spec, lp, x, mod, kv[0], kv[1], st), None

        x, _ = scan_layers(body, x, params.layers, (st.k, st.v))
        return _mlp(params.action_out, x[:, -ha:], _gelu).astype(jnp.float32)

    feats = sinusoid(jnp.broadcast_to(t_in, (b,)), spec.time_embed_dim, cos_first=True, freq_shift=1).astype(dtype)
    temb = _mlp(params.time_mlp, feats, jax.nn.silu)  # [B, Da]
    enc = params.action_in
    tau = sinusoid(jnp.broadcast_to(t_in, (b, ha)), spec.width, cos_first=False).astype(dtype)
    a = jnp.concatenate([_lin("BTA,AD->BTD", x_t, enc.w1), tau], axis=-1)
    a = _lin("BTD,DE->BTE", jax.nn.silu(_lin("BTC,CD->BTD", a, enc.w2)), enc.w3)
    x = jnp.concatenate([st.extra, a + params.positions[:ha].astype(dtype)[None]], axis=1)
    temb_act = jax.nn.silu(temb)

    def body(x, blk, kv, _):
        if isinstance(blk, BlockPair):
            x = _cross_block(spec, blk.cross, x, temb_act, kv[0], kv[1], st.mask)
            return _cross_block(spec, blk.self_, x, temb_act, None, None, None), None
        return _cross_block(spec, blk, x, temb_act, kv[0], kv[1], st.mask), None

    x, _ = scan_layers(body, x, params.blocks, (st.k, st.v))
    x = x[:, -ha:]
    if params.out_proj is not None:  # GR00T's DiT output block; QwenPI_v3 decodes the blocks' output directly
        shift, scale = jnp.split(_lin("BD,D2E->B2E", temb_act, params.out_mod), 2, axis=1)
        x = _lin("BTD,DO->BTO", _layer_norm(x, 1e-6) * (1 + scale) + shift, params.out_proj)
    return _mlp(params.action_out, x, jax.nn.relu).astype(jnp.float32)


def _check_noise(spec: HeadSpec, noise: jax.Array, b: int) -> None:
    want = (b, spec.horizon, spec.action_dim)
    if noise.shape != want:
        raise ValueError(f"head {spec.name!r} needs noise [B, Ha, Ad] = {want}, got {noise.shape}")


def denoise(params: HeadParams, spec: HeadSpec, st: HeadState, noise: jax.Array) -> jax.Array:
    """`spec.num_steps` Euler steps of the head's flow from `noise`, reading `st` only.

    Args:
      noise: [B, Ha, Ad] x at the noise end (t = 0 for 0_to_1 heads, t = 1 for 1_to_0).
    Returns:
      actions float32 [B, Ha, Ad] (normalised, in the head's action space).
    """
    _check_params(spec, params)
    _check_noise(spec, noise, st.mask.shape[0])
    dt = (1.0 if spec.t_direction == "0_to_1" else -1.0) / spec.num_steps

    def step(i, x):
        return x + dt * velocity(params, spec, st, x, i)

    return jax.lax.fori_loop(0, spec.num_steps, step, noise.astype(jnp.float32))


def sample(params: HeadParams, spec: HeadSpec, prefix: PrefixOutputs, noise: jax.Array,
           state: jax.Array | None = None) -> jax.Array:
    """`denoise(prepare(prefix))`: one action chunk [B, Ha, Ad] from a shared prefix."""
    _check_noise(spec, noise, prefix.mask.shape[0])
    return denoise(params, spec, prepare(params, spec, prefix, state), noise)


# --------------------------------------------------------------------------------------------------
# Presets


def _xr0(name, *, width, depth, heads, kv_heads, head_dim, mlp, kv_layers, horizon=30, action_dim=32, state_dim=32, steps=5):
    return HeadSpec(
        name=name, kind="joint_kv", width=width, depth=depth, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        mlp_dim=mlp, action_dim=action_dim, horizon=horizon, num_steps=steps, t_direction="0_to_1",
        time_cond="adaln_table", time_input="continuous", kv_layers=tuple(kv_layers), block_pattern="joint",
        extra_tokens=("sink", "state"), state_dim=state_dim, positions="continue_rope", suffix_mask="causal",
    )


def _starvla(name, *, width, depth, heads, head_dim, vlm_width, proj, vlm_depth, future=32, horizon=16, action_dim=7,
             steps=4, io_hidden=1024, max_positions=1024):
    return HeadSpec(
        name=name, kind="cross_hidden", width=width, depth=depth, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
        mlp_dim=4 * width, action_dim=action_dim, horizon=horizon, num_steps=steps, t_direction="0_to_1",
        time_cond="adaln_scale_shift", time_input="bucket", hidden_layers=tuple(range(vlm_depth - depth + 1, vlm_depth + 1)),
        vlm_width=vlm_width, hidden_proj=proj, block_pattern="all_cross", extra_tokens=("future",), num_future_tokens=future,
        positions="learned", max_positions=max_positions, io_hidden=io_hidden,
    )


def _gr00t(name, *, width, depth, heads, head_dim, vlm_width, vlm_depth, out_dim, future=32, horizon=8, action_dim=7,
           state_dim=7, steps=4, io_hidden=1024, max_positions=1024):
    return HeadSpec(
        name=name, kind="cross_last", width=width, depth=depth, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
        mlp_dim=4 * width, action_dim=action_dim, horizon=horizon, num_steps=steps, t_direction="0_to_1",
        time_cond="adaln_scale_shift", time_input="bucket", hidden_layers=(vlm_depth,) * (depth // 2), vlm_width=vlm_width,
        block_pattern="cross_self", extra_tokens=("state", "future"), state_dim=state_dim, num_future_tokens=future,
        positions="learned", max_positions=max_positions, dit_output_dim=out_dim, io_hidden=io_hidden,
    )


def xr0() -> HeadSpec:
    """Xiaomi-Robotics-0's action DiT on Qwen3-VL-4B (36 x 2560, 8 KV heads x 128).

    Read from public code: the `XR0` / `DiT` / `DecoderLayer` / `DiTAttention` classes of a fork of
    the XR0 training code (rosmontis2005/Xiaomi-Robotics-0-orchardbech @ 0a9eb3b,
    `xr0/mibot/models/VLA/XR0.py`) and the notes in shared/docs/mot_families.md (physicalai and
    LeRobot ports). 16 layers x 1024, head_dim 128, 8 heads, 8 KV heads (`kv_heads=8`), fused qkv
    with bias, o_proj without, q/k RMSNorm, SwiGLU 4096 without biases, four RMSNorms per layer,
    `adaln_table [6, D]` per layer + one shared `t_projector` Linear(D, 6D); time = sinusoid(t x
    1000) (cos first, 256) -> Linear/SiLU/Linear without biases; tokens [sink, state MLP, action
    MLP] (MLPProjector: Linear(in, out), GELU-tanh, Linear(out, out), no biases); layer i reads
    the K/V of VLM layer 36 - 16 + i; M-RoPE continuing at max prefix position + 1; 30 x 32
    actions, 5 Euler steps with t: 0 -> 1.

    Ambiguous in public code (the defaults follow the inference path):
    * the training code adds +10 to the action tokens' positions and bands action-action attention
      to 4 previous actions; a port of the published inference code (`modeling_mibot.py`) applies
      neither. Here `action_position_offset=0`, `suffix_window=None`; both are spec fields.
    * XR0 takes the per-axis max of the prefix M-RoPE positions; here all axes continue at
      `next_position` (max over axes + 1). They agree when the prefix ends in text, as XR0's does
      (its prompt closes with the assistant turn).
    * the DiT's own K/V use N heads in the public code, K heads here; equal for XR0 (N = K = 8).
    * action_mask (zeroing padded action dims of the input) is all ones at inference; not modelled.
    Size: 278,458,368 head parameters; with the 4,437,815,808 of Qwen3-VL-4B, 4,716,274,176
    (published: 4.7B).
    """
    return _xr0("xr0", width=1024, depth=16, heads=8, kv_heads=8, head_dim=128, mlp=4096, kv_layers=range(20, 36))


def starvla_qwenpi_v3() -> HeadSpec:
    """StarVLA QwenPI_v3 (Qwen3VL-PI_v3) on Qwen3-VL-4B: layer-wise cross-attention to projected hidden states.

    Read from starVLA/starVLA @ 0ed0aad: `QwenPI_v3.py` (`project_layers`: LayerNorm(2560) +
    Linear(2560, 1024) per layer; `hidden_states[-36:]`, so block i reads HF index i + 1 and block
    35 the final-normed output), `LayerwiseFM_ActionHeader.py` (ActionEncoder with the bucketed
    time mixed into every action token, learned position table of 1024 rows, 32 future tokens,
    action decoder MLP(1024 -> 1024 -> 7) on the blocks' output (`return_pre_output=True`), cross
    mask = backbone attention mask, t: 0 -> 1 in 4 steps, time bucket int(t * 1000)) and
    `cross_attention_dit.py` (36 BasicTransformerBlocks, 16 heads x 64 with biases, AdaLayerNorm,
    GELU-tanh FF 4096, legacy all-cross since commit 7276c5e).

    Size: project_layers 94,593,024 and 535,494,663 head parameters here, against the docstring's
    action_model 538,678,305 (TOTAL 5,071,087,137). The 3,183,642 difference are checkpoint
    weights QwenPI_v3's inference never runs: the DiT's output block (`proj_out_1` 2,099,200,
    `proj_out_2` to GR00T's default output_dim 26, 26,650; skipped by `return_pre_output`) and the
    state encoder (1,057,792; QwenPI_v3 writes the state into the prompt and passes state=None).
    Not verified: whether the released checkpoint was trained with the interleaved self-attention
    forward (the repository warns that old checkpoints need their own code snapshot); the horizon
    16 and action dim 7 are framework defaults a checkpoint config may override.
    """
    return _starvla("starvla_qwenpi_v3", width=1024, depth=36, heads=16, head_dim=64, vlm_width=2560, proj=1024, vlm_depth=36)


def gr00t() -> HeadSpec:
    """StarVLA QwenGR00T (DiT-B) on Qwen3-VL-4B: cross-attention to the last hidden state only.

    Read from starVLA/starVLA @ 0ed0aad: `QwenGR00T.py` (`hidden_states[-1]`, the final-normed
    output, with the backbone attention mask; DiT-B: 16 blocks x 768, 12 heads x 64; cross dim =
    VLM width 2560; interleaved: even blocks cross-attend, odd blocks self-attend; output_dim 1024;
    horizon 8 x 7; state_dim 7; 4 steps) and `GR00T_ActionHeader.py` (state MLP token, 32 future
    tokens, learned positions, DiT output block (LayerNorm modulated by proj_out_1, then proj_out_2
    to 1024) and action decoder MLP(1024 -> 1024 -> 7)). No published parameter count.
    """
    return _gr00t("gr00t", width=768, depth=16, heads=12, head_dim=64, vlm_width=2560, vlm_depth=36, out_dim=1024)


_PRESETS = {
    "xr0": xr0,
    "starvla_qwenpi_v3": starvla_qwenpi_v3,
    "gr00t": gr00t,
    # Benchmark scale, for `mot.preset("bench")`'s backbone (1024 x 8, 4 KV heads x 128).
    "xr0_bench": lambda: _xr0("xr0", width=512, depth=4, heads=4, kv_heads=4, head_dim=128, mlp=2048, kv_layers=range(4, 8)),
    "starvla_bench": lambda: _starvla("starvla_qwenpi_v3", width=512, depth=8, heads=8, head_dim=64, vlm_width=1024,
                                      proj=512, vlm_depth=8),
    "gr00t_bench": lambda: _gr00t("gr00t", width=384, depth=4, heads=6, head_dim=64, vlm_width=1024, vlm_depth=8, out_dim=512),
    # Test scale, for `backbone.preset("qwen3vl_tiny")` (64 x 3, 2 KV heads x 16).
    "xr0_tiny": lambda: _xr0("xr0", width=32, depth=2, heads=2, kv_heads=2, head_dim=16, mlp=64, kv_layers=(1, 2),
                             horizon=6, action_dim=8, state_dim=5, steps=3),
    "starvla_tiny": lambda: _starvla("starvla_qwenpi_v3", width=32, depth=3, heads=2, head_dim=16, vlm_width=64, proj=32,
                                     vlm_depth=3, future=4, horizon=5, steps=2, io_hidden=24, max_positions=8),
    "gr00t_tiny": lambda: _gr00t("gr00t", width=32, depth=2, heads=2, head_dim=16, vlm_width=64, vlm_depth=3, out_dim=16,
                                 future=3, horizon=4, state_dim=6, steps=2, io_hidden=24, max_positions=8),
}


def preset(name: str) -> HeadSpec:
    """A named head: 'xr0', 'starvla_qwenpi_v3', 'gr00t' (full size, on Qwen3-VL-4B), their '_bench'
    and '_tiny' variants (same names inside, for the bench and tiny backbones of `mot.preset`)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown head preset {name!r}; choose one of {sorted(_PRESETS)}")
    return _PRESETS[name]()
