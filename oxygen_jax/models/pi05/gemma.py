"""π0.5's Gemma experts with their original spec-free signatures: a thin adapter over `backbone`.

Axis legend: B batch, T query tokens, S key tokens, D expert width, L layers, K KV heads, H head dim.

There is no transformer maths here: every function runs `backbone` with π0.5's Gemma spec, read off
the weights' shapes (`expert_spec`). `model.py` and `decode.py` call `backbone` directly with
`backbone.pi05_spec(params.config, expert)`; this module keeps older call sites
(`gemma.forward_prefill(params.vlm.layers, ...)`, `gemma.rms_norm(h, params.vlm.final_norm)`) working.
"""

from __future__ import annotations

from oxygen_jax.models import backbone
from oxygen_jax.models.backbone import BackboneSpec
from oxygen_jax.models.pi05.config import PALIGEMMA_VOCAB_SIZE, ExpertConfig, model_config
from oxygen_jax.models.lora import RowAdapters
from oxygen_jax.nn.layers import AdaRMSNorm, RMSNorm, Unstacked
from oxygen_jax.models.pi05.params import ExpertLayers

# `backbone.rms_norm` reads only the norm fields of a spec ((1 + w), eps), the same in every π0.5 spec.
_NORM_SPEC = backbone.pi05_spec(model_config("tiny"))


def expert_spec(layers: ExpertLayers | Unstacked) -> BackboneSpec:
    """π0.5's Gemma spec for an expert's layers (stacked or `Unstacked`), dims read from the weights.

    Equals `backbone.pi05_spec(config, expert)` on everything a layer stack reads; the vocabulary
    (PaliGemma's) and the vision encoder are not recoverable from layers and are never read by one.
    """
    unstacked = isinstance(layers, Unstacked)
    lp = layers.layers[0] if unstacked else layers  # q [(L,) N, D, H], kv [(L,) 2, K, D, H], gating [(L,) 2, D, F]
    n, d, h = lp.q.shape[-3:]
    depth = len(layers.layers) if unstacked else lp.q.shape[0]
    expert = ExpertConfig(width=d, depth=depth, mlp_dim=lp.gating.shape[-1], num_heads=n, num_kv_heads=lp.kv.shape[-3],
                          head_dim=h)
    return backbone.gemma_spec(expert, vocab_size=PALIGEMMA_VOCAB_SIZE)


def rms_norm(x, norm: RMSNorm | AdaRMSNorm, cond=None):
    """`backbone.rms_norm` with π0.5's `(1 + scale)` norm: (normed x [B, T, D], adaRMS gate or None)."""
    return backbone.rms_norm(_NORM_SPEC, x, norm, cond)


def forward_prefill(layers: ExpertLayers | Unstacked, x, positions, mask, cond=None):
    """`backbone.forward_prefill` for a π0.5 expert: (hidden [B, T, D], (k, v) each [L, B, T, K, H])."""
    return backbone.forward_prefill(expert_spec(layers), layers, x, positions, mask, cond=cond)


def forward_read(layers: ExpertLayers | Unstacked, x, positions, mask, cache_k, cache_v, cond=None):
    """`backbone.forward_read` for a π0.5 expert: hidden [B, T, D] attending to cache ‖ itself."""
    return backbone.forward_read(expert_spec(layers), layers, x, positions, mask, cache_k, cache_v, cond)


def forward_write(layers: ExpertLayers | Unstacked, x, positions, mask, cache_k, cache_v, write_index, cond=None,
                  lora: RowAdapters | None = None):
    """`backbone.forward_write` for a π0.5 expert (per-row LoRA included): (hidden, (cache_k, cache_v))."""
    return backbone.forward_write(expert_spec(layers), layers, x, positions, mask, cache_k, cache_v, write_index,
                                  cond, lora)
