"""Named heads: the published XR0, StarVLA QwenPI_v3 and QwenGR00T heads on Qwen3-VL-4B, with the public
code each was read from and what stayed ambiguous, plus their `_bench` and `_tiny` scales, and
`for_backbone`: a head kind at one of those scales sized to any backbone (random weights, for measurement).

Axes: none (specs only; the dims are the spec types' fields).
"""

from __future__ import annotations

from oxygen_jax.models.backbone import BackboneSpec
from oxygen_jax.models.heads.cross import CrossHiddenSpec, CrossLastSpec
from oxygen_jax.models.heads.joint import JointKvSpec
from oxygen_jax.models.heads.spec import HeadSpec


def _xr0(name, *, width, depth, heads, kv_heads, head_dim, mlp, kv_layers, horizon=30, action_dim=32, state_dim=32, steps=5):
    return JointKvSpec(
        name=name, width=width, depth=depth, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        mlp_dim=mlp, action_dim=action_dim, horizon=horizon, num_steps=steps, time_input="continuous",
        kv_layers=tuple(kv_layers), state_dim=state_dim,
    )


def _starvla(name, *, width, depth, heads, head_dim, vlm_width, proj, vlm_depth, future=32, horizon=16, action_dim=7,
             steps=4, io_hidden=1024, max_positions=1024, hidden_states=None):
    return CrossHiddenSpec(
        name=name, width=width, depth=depth, num_heads=heads, head_dim=head_dim, mlp_dim=4 * width,
        action_dim=action_dim, horizon=horizon, num_steps=steps, time_input="bucket",
        hidden_layers=tuple(range(vlm_depth - depth + 1, vlm_depth + 1)), vlm_width=vlm_width, hidden_proj=proj,
        block_pattern="all_cross", num_future_tokens=future, max_positions=max_positions, io_hidden=io_hidden,
        hidden_states=hidden_states,
    )


def _gr00t(name, *, width, depth, heads, head_dim, vlm_width, vlm_depth, out_dim, future=32, horizon=8, action_dim=7,
           state_dim=7, steps=4, io_hidden=1024, max_positions=1024, hidden_states=None):
    return CrossLastSpec(
        name=name, width=width, depth=depth, num_heads=heads, head_dim=head_dim, mlp_dim=4 * width,
        action_dim=action_dim, horizon=horizon, num_steps=steps, time_input="bucket", hidden_layer=vlm_depth,
        vlm_width=vlm_width, block_pattern="cross_self", state_dim=state_dim, num_future_tokens=future,
        max_positions=max_positions, dit_output_dim=out_dim, io_hidden=io_hidden, hidden_states=hidden_states,
    )


def xr0() -> HeadSpec:
    """Xiaomi-Robotics-0's action DiT on Qwen3-VL-4B (36 x 2560, 8 KV heads x 128).

    Read from public code: the `XR0` / `DiT` / `DecoderLayer` / `DiTAttention` classes of a fork of
    the XR0 training code (rosmontis2005/Xiaomi-Robotics-0-orchardbech @ 0a9eb3b,
    `xr0/mibot/models/VLA/XR0.py`) and notes on its physicalai and LeRobot ports (kept outside this
    repository). 16 layers x 1024, head_dim 128, 8 heads, 8 KV heads (`kv_heads=8`), fused qkv
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
    Linear(2560, 1024) per layer; `hidden_states[-36:]`, so block i reads HF index i + 1),
    `LayerwiseFM_ActionHeader.py` (ActionEncoder with the bucketed
    time mixed into every action token, learned position table of 1024 rows, 32 future tokens,
    action decoder MLP(1024 -> 1024 -> 7) on the blocks' output (`return_pre_output=True`), cross
    mask = backbone attention mask, t: 0 -> 1 in 4 steps, time bucket int(t * 1000)) and
    `cross_attention_dit.py` (36 BasicTransformerBlocks, 16 heads x 64 with biases, AdaLayerNorm,
    GELU-tanh FF 4096, legacy all-cross since commit 7276c5e).

    Hidden states: StarVLA pins transformers 4.57.0, whose `hidden_states` entries after DeepStack
    layers are post-DeepStack and whose last entry is the last layer's output before the final norm
    (`hidden_states="transformers_4_57"`, `models.hidden_states`; measured against
    StarVLA's reference outputs, which this head matches to 1e-4: `eval/parity/starvla.py`). So blocks 0..2 read
    post-DeepStack residuals and block 35 the un-normed last layer. The per-step times are k / S
    (buckets int(k / S * 1000) = 0, 250, 500, 750); the head is never evaluated at t = 1.

    Size: project_layers 94,593,024 and 535,494,663 head parameters here, against the docstring's
    action_model 538,678,305 (TOTAL 5,071,087,137). The 3,183,642 difference are checkpoint
    weights QwenPI_v3's inference never runs: the DiT's output block (`proj_out_1` 2,099,200,
    `proj_out_2` to GR00T's default output_dim 26, 26,650; skipped by `return_pre_output`) and the
    state encoder (1,057,792; QwenPI_v3 writes the state into the prompt and passes state=None).
    Not verified: whether the released checkpoint was trained with the interleaved self-attention
    forward (the repository warns that old checkpoints need their own code snapshot); the horizon
    16 and action dim 7 are framework defaults a checkpoint config may override.
    """
    return _starvla("starvla_qwenpi_v3", width=1024, depth=36, heads=16, head_dim=64, vlm_width=2560, proj=1024, vlm_depth=36,
                    hidden_states="transformers_4_57")


def gr00t() -> HeadSpec:
    """StarVLA QwenGR00T (DiT-B) on Qwen3-VL-4B: cross-attention to the last hidden state only.

    Read from starVLA/starVLA @ 0ed0aad: `QwenGR00T.py` (`hidden_states[-1]`: under transformers
    4.57.0, StarVLA's pin, the last layer's output BEFORE the final norm (`hidden_states=
    "transformers_4_57"`, `models.hidden_states`; measured against StarVLA's reference outputs,
    which this head matches to 1e-4), with the backbone attention mask; DiT-B: 16 blocks x 768, 12 heads x 64; cross dim =
    VLM width 2560; interleaved: even blocks cross-attend, odd blocks self-attend (any depth: 5 blocks are cross 0, 2, 4); output_dim 1024;
    horizon 8 x 7; state_dim 7; 4 steps) and `GR00T_ActionHeader.py` (state MLP token, 32 future
    tokens, learned positions, DiT output block (LayerNorm modulated by proj_out_1, then proj_out_2
    to 1024; `shift, scale = proj_out_1(silu(temb)).chunk(2)`, the reverse of the blocks' AdaLayerNorm
    (scale, shift)) and action decoder MLP(1024 -> 1024 -> 7)). The state token exists only with a
    state and comes first; times k / S, never t = 1. No published parameter count.
    """
    return _gr00t("gr00t", width=768, depth=16, heads=12, head_dim=64, vlm_width=2560, vlm_depth=36, out_dim=1024,
                  hidden_states="transformers_4_57")


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


KINDS = {"xr0": "xr0", "starvla": "starvla_qwenpi_v3", "gr00t": "gr00t"}
"""Head kinds `for_backbone` builds -> the head's name inside a model (the published heads' names)."""

# The head's own size per scale (what does not depend on the backbone): the `_tiny` / `_bench` presets' values.
_SCALES = {
    "tiny": {
        "xr0": dict(width=32, depth=2, mlp=64, horizon=6, action_dim=8, state_dim=5, steps=3),
        "starvla": dict(width=32, depth=3, heads=2, head_dim=16, proj=32, future=4, horizon=5, steps=2, io_hidden=24,
                        max_positions=8),
        "gr00t": dict(width=32, depth=2, heads=2, head_dim=16, out_dim=16, future=3, horizon=4, state_dim=6, steps=2,
                      io_hidden=24, max_positions=8),
    },
    "bench": {
        "xr0": dict(width=512, depth=4, mlp=2048),
        "starvla": dict(width=512, depth=8, heads=8, head_dim=64, proj=512),
        "gr00t": dict(width=384, depth=4, heads=6, head_dim=64, out_dim=512),
    },
}


def for_backbone(kind: str, backbone: BackboneSpec, scale: str = "tiny", *, reads_kv: bool | None = None) -> HeadSpec:
    """A head of `kind` ('xr0', 'starvla', 'gr00t') at `scale` ('tiny', 'bench') that fits `backbone`.

    What the head reads comes from the backbone; its own width and depth from the scale (the `_tiny` /
    `_bench` presets' values, the depth capped at the backbone's):

    * xr0: K/V heads and head_dim of the backbone (N = K query heads, as released), `kv_layers` = the last
      `depth` layers. On a 3-layer backbone at tiny scale (depth 2): kv_layers (1, 2).
    * starvla (QwenPI_v3): `vlm_width` = D, `hidden_layers` = the last `depth` hidden states (HF indices
      L - depth + 1 .. L). On 3 layers at tiny scale (depth 3): (1, 2, 3).
    * gr00t (QwenGR00T): `vlm_width` = D, `hidden_layer` = L (the last hidden state).

    `reads_kv`: whether every layer of the backbone keeps K/V (default: all but Qwen3.5's hybrid stack,
    whose linear-attention layers keep none); without them only hidden-state heads fit. The result passes
    `check_backbone(backbone)`.

    Raises:
      ValueError: an unknown kind or scale, or xr0 on a backbone without K/V (one line naming what fits).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown head kind {kind!r}; choose from {', '.join(KINDS)}")
    if scale not in _SCALES:
        raise ValueError(f"unknown head scale {scale!r}; choose from {', '.join(_SCALES)}")
    if reads_kv is None:
        reads_kv = backbone.family != "qwen3_5"
    if kind == "xr0" and not reads_kv:
        raise ValueError(f"head kind 'xr0' reads the backbone's K/V, which this {backbone.family} backbone's "
                         "linear-attention layers do not keep; heads that fit it: starvla, gr00t")
    s, depth = _SCALES[scale][kind], backbone.depth
    rest = {k: v for k, v in s.items() if k not in ("width", "depth", "mlp", "heads", "head_dim", "proj", "out_dim")}
    if kind == "xr0":
        d = min(s["depth"], depth)
        k = backbone.num_kv_heads
        head = _xr0(KINDS[kind], width=s["width"], depth=d, heads=k, kv_heads=k, head_dim=backbone.head_dim,
                    mlp=s["mlp"], kv_layers=range(depth - d, depth), **rest)
    elif kind == "starvla":
        head = _starvla(KINDS[kind], width=s["width"], depth=min(s["depth"], depth), heads=s["heads"],
                        head_dim=s["head_dim"], vlm_width=backbone.width, proj=s["proj"], vlm_depth=depth, **rest)
    else:
        head = _gr00t(KINDS[kind], width=s["width"], depth=s["depth"], heads=s["heads"], head_dim=s["head_dim"],
                      vlm_width=backbone.width, vlm_depth=depth, out_dim=s["out_dim"], **rest)
    head.check_backbone(backbone)
    return head
