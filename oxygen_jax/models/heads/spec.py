"""`HeadSpec`: what one action head reads from the prefix, its dims and its flow (all three kinds).

Axes (`oxygen_jax.axes`, plus the heads' own of `models.heads`): Da head width, N heads, K KV heads,
H head dim, F head MLP, Ha horizon, Ad action dim, Ds state dim, Dt time features, Do DiT output
width, Fo state/action MLP width, Ne extra tokens, Lc cross blocks, Dx cross context width.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from oxygen_jax.models.backbone import BackboneSpec
from oxygen_jax.models.hidden_states import check_semantics

Kind = Literal["joint_kv", "cross_hidden", "cross_last", "adarms_joint"]
_EXTRA = {"joint_kv": ("sink", "state"), "cross_hidden": ("state", "future"), "cross_last": ("state", "future"),
          "adarms_joint": ()}


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


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
    num_kv_heads: int  # K: joint_kv: the backbone's (its cache is repeated to the N heads of the DiT's own K/V); cross: = N
    head_dim: int  # H: joint_kv must equal the backbone's
    mlp_dim: int  # F (SwiGLU for joint, GELU-tanh for cross)
    action_dim: int  # Ad
    horizon: int  # Ha
    num_steps: int  # Euler steps (static)
    t_direction: Literal["0_to_1", "1_to_0"]  # 0_to_1: t = 0 noise -> 1 actions (XR0, StarVLA); 1_to_0: π0.5
    time_cond: Literal["adaln_table", "adaln_scale_shift", "adarms"]  # XR0's adaLN-single / diffusers' AdaLayerNorm /
    #   π0.5's adaRMSNorm (adarms_joint)
    time_input: Literal["continuous", "bucket"]  # the network sees t * time_scale, or floor(t * time_scale)
    time_scale: int = 1000
    time_embed_dim: int = 256  # Dt
    kv_layers: tuple[int, ...] = ()  # joint_kv: backbone layer read by each head layer
    hidden_layers: tuple[int, ...] = ()  # cross: HF hidden_states index read by each cross block (0 = embeddings,
    #   L = the last entry), in the backbone's `BackboneSpec.hidden_states` convention (`models.hidden_states`)
    hidden_states: str | None = None  # cross: the convention the head was trained with ("transformers_4_57" for
    #   StarVLA, whose pin is 4.57.0); the backbone must report it. None: any (random-weight tests, benchmarks)
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
    action_mask: tuple[tuple[int, ...], ...] | None = None  # joint: [Ha][Ad] 0/1, multiplies the noisy action
    #   at every step (XR0 `modeling_mibot.py`: the robot's `processor.get_action_mask`); None = all ones
    dit_output_dim: int | None = None  # cross: adaLN output block + Linear(Da -> Do) before the decoder
    io_hidden: int = 0  # cross: Fo

    def __post_init__(self):
        name = f"HeadSpec {self.name!r}"
        _require(bool(self.name), "HeadSpec.name must be a non-empty string")
        _require(self.kind in _EXTRA, f"{name}: kind must be 'joint_kv', 'cross_hidden', 'cross_last' or 'adarms_joint', got {self.kind!r}")
        for f in ("width", "depth", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "action_dim",
                  "num_steps", "time_scale", "time_embed_dim"):
            _require(getattr(self, f) > 0, f"{name}: {f} must be positive, got {getattr(self, f)}")
        _require(self.horizon > 0 or (self.horizon == 0 and self.kind == "adarms_joint"),
                 f"{name}: horizon must be positive (0, the caller's chunk length, only for adarms_joint), got {self.horizon}")
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
        elif self.kind == "adarms_joint":
            self._check_adarms(name)
        else:
            self._check_cross(name)

    def _check_joint(self, name: str) -> None:
        _require(self.block_pattern == "joint", f"{name}: a joint_kv head has block_pattern='joint', got {self.block_pattern!r}")
        _require(self.time_cond == "adaln_table", f"{name}: joint_kv heads implement time_cond='adaln_table' only")
        _require(self.positions == "continue_rope", f"{name}: joint_kv heads continue the prefix RoPE (positions='continue_rope')")
        _require(self.head_dim % 2 == 0, f"{name}: head_dim must be even for RoPE, got {self.head_dim}")
        _require(len(self.kv_layers) == self.depth,
                 f"{name}: kv_layers must name one backbone layer per head layer ({self.depth}), got {len(self.kv_layers)}")
        _require(not self.hidden_layers and self.hidden_proj is None and self.dit_output_dim is None and self.hidden_states is None,
                 f"{name}: hidden_layers / hidden_proj / dit_output_dim / hidden_states belong to cross heads")
        _require(self.suffix_mask in ("causal", "bidirectional"), f"{name}: suffix_mask must be 'causal' or 'bidirectional'")
        _require(self.suffix_window is None or self.suffix_window >= 0, f"{name}: suffix_window must be None or >= 0")
        _require(self.action_position_offset >= 0, f"{name}: action_position_offset must be >= 0")
        if self.action_mask is not None:
            rows = self.action_mask
            _require(len(rows) == self.horizon and all(len(r) == self.action_dim for r in rows)
                     and all(v in (0, 1) for r in rows for v in r),
                     f"{name}: action_mask must be {self.horizon} rows (horizon) of {self.action_dim} entries (action_dim), "
                     f"each 0 or 1; build it with tuple(tuple(int(v) for v in row) for row in mask)")
        _require(self.num_future_tokens == 0, f"{name}: future tokens belong to cross heads")

    def _check_adarms(self, name: str) -> None:
        """π0.5's action expert (`heads/adarms.py`): every backbone layer's K/V, adaRMS time, the accumulated clock."""
        _require(self.block_pattern == "joint" and self.positions == "continue_rope" and self.suffix_mask == "bidirectional",
                 f"{name}: an adarms_joint head is joint (block_pattern='joint'), continues the prefix RoPE "
                 "(positions='continue_rope') and is bidirectional inside its chunk (suffix_mask='bidirectional')")
        _require(self.time_cond == "adarms" and self.time_input == "continuous" and self.t_direction == "1_to_0",
                 f"{name}: an adarms_joint head has time_cond='adarms', time_input='continuous', t_direction='1_to_0' "
                 "(openpi's float32 clock from t = 1)")
        _require(self.time_embed_dim == self.width, f"{name}: adarms time features are sincos of the head width "
                                                    f"(time_embed_dim = width = {self.width}), got {self.time_embed_dim}")
        _require(self.kv_layers == tuple(range(self.depth)),
                 f"{name}: head layer l reads backbone layer l: kv_layers must be (0, ..., {self.depth - 1}), got {self.kv_layers}")
        _require(not self.extra_tokens and self.state_dim == 0 and self.num_future_tokens == 0,
                 f"{name}: an adarms_joint head has no extra tokens (π0.5 reads the state as prompt tokens)")
        _require(not self.hidden_layers and self.hidden_proj is None and self.dit_output_dim is None and self.hidden_states is None,
                 f"{name}: hidden_layers / hidden_proj / dit_output_dim / hidden_states belong to cross heads")
        _require(self.suffix_window is None and self.action_position_offset == 0 and self.action_mask is None,
                 f"{name}: suffix_window / action_position_offset / action_mask belong to joint_kv heads")

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
        if self.hidden_states is not None:
            check_semantics(self.hidden_states)
        _require(len(self.hidden_layers) == self.num_cross_blocks,
                 f"{name}: hidden_layers must name one hidden state per cross block ({self.num_cross_blocks}), got {len(self.hidden_layers)}")
        if self.kind == "cross_last":
            _require(len(set(self.hidden_layers)) == 1,
                     f"{name}: a cross_last head reads one hidden state (the last) in every cross block, got {self.hidden_layers}")
        _require(("future" in self.extra_tokens) == (self.num_future_tokens > 0),
                 f"{name}: a 'future' extra token needs num_future_tokens > 0 and the converse")
        _require(self.suffix_window is None and self.action_position_offset == 0 and self.action_mask is None,
                 f"{name}: suffix_window / action_position_offset / action_mask belong to joint_kv heads")

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
        if self.kind == "adarms_joint":
            _require(self.depth == spec.depth, f"{name}: an adarms_joint head has one layer per backbone layer: depth "
                                               f"{self.depth} must equal the backbone's {spec.depth}")
        if self.kind in ("joint_kv", "adarms_joint"):
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
                         f"{name}: a cross_last head reads hidden_states[{spec.depth}] (the last entry), got {self.hidden_layers[0]}")
            _require(self.hidden_states in (None, spec.hidden_states),
                     f"{name}: trained on {self.hidden_states} hidden states, but the backbone reports {spec.hidden_states}; "
                     f"build it with BackboneSpec.replace(hidden_states={self.hidden_states!r})")

    def replace(self, **changes) -> HeadSpec:
        return dataclasses.replace(self, **changes)
