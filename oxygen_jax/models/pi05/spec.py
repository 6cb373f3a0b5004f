"""π0.5's two Gemma experts as instances of the one transformer, `backbone.BackboneSpec`.

Axes (`oxygen_jax.axes`): L layers, D expert width, N query heads, K KV heads, H head dim, F MLP hidden.

`pi05_spec(config, "vlm")` runs the VLM expert (embedder, SigLIP, tied head; `model.vlm_decoder`),
`pi05_spec(config, "action_expert")` the action expert's bare stack (adaRMSNorm through `cond`).
"""

from __future__ import annotations

from typing import Literal

from oxygen_jax.models.backbone import BackboneSpec, DecoderLayers, RopeSpec
from oxygen_jax.models.pi05.config import ExpertConfig, ModelConfig, PromptAttention
from oxygen_jax.models.pi05.params import ExpertLayers
from oxygen_jax.models.vision.siglip import SiglipConfig
from oxygen_jax.nn.layers import Unstacked


def gemma_spec(expert: ExpertConfig, *, vocab_size: int, prefix_attention: PromptAttention = "bidirectional",
               vision: SiglipConfig | None = None, embed_scale_dtype: str | None = None) -> BackboneSpec:
    """π0.5's Gemma maths at `expert`'s dims.

    geglu-tanh MLP, `(1 + w)` RMSNorms, 1-D RoPE (theta 1e4, angles divided exactly as openpi does),
    sqrt(D)-scaled embeddings, tied head.
    """
    e = expert
    return BackboneSpec(
        family="gemma", width=e.width, depth=e.depth, num_heads=e.num_heads, num_kv_heads=e.num_kv_heads,
        head_dim=e.head_dim, mlp_dim=e.mlp_dim, vocab_size=vocab_size, mlp="geglu_tanh",
        norm_plus_one=True, qk_norm=False, rope=RopeSpec(theta=10_000.0, exact_division=True), embed_scale=True, tie_embeddings=True,
        prefix_attention=prefix_attention, vision=vision, embed_scale_dtype=embed_scale_dtype,
    )


def pi05_spec(config: ModelConfig, expert: Literal["vlm", "action_expert"] = "vlm") -> BackboneSpec:
    """π0.5's VLM expert (with the embedder, SigLIP and the tied head) or its action expert as a spec.

    The action expert has no embedder or head of its own; its spec only drives the stack (with
    adaRMSNorm through `cond`). Run the stack on `params.vlm.layers` / `params.action_expert.layers`.
    """
    if expert not in ("vlm", "action_expert"):
        raise ValueError(f"pi05_spec: expert must be 'vlm' or 'action_expert', got {expert!r}")
    return gemma_spec(getattr(config, expert), vocab_size=config.vocab_size, prefix_attention=config.prompt_attention,
                      vision=config.siglip if expert == "vlm" else None,
                      embed_scale_dtype=config.embed_scale_dtype if expert == "vlm" else None)


def from_expert_layers(layers: ExpertLayers | Unstacked) -> DecoderLayers | Unstacked:
    """π0.5's `ExpertLayers` as `DecoderLayers` (no q/k-norm); the same arrays, no copy."""
    if isinstance(layers, Unstacked):
        return Unstacked(layers=tuple(from_expert_layers(lp) for lp in layers.layers))
    return DecoderLayers(q=layers.q, kv=layers.kv, out=layers.out, attn_norm=layers.attn_norm,
                         ffw_norm=layers.ffw_norm, gating=layers.gating, linear=layers.linear)
