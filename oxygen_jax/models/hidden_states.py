"""What Hugging Face's `output_hidden_states` holds, per transformers version: the two conventions a
Qwen3-VL backbone can report its hidden states in (`BackboneSpec.hidden_states`).

Axes (`oxygen_jax.axes`): L layers, Ed DeepStack layers, B batch, T tokens, D width.

`hidden_states` has L + 1 entries (HF indices 0..L). Entry 0 is the input embeddings (after the image
scatter) under both conventions; they differ in the entries after DeepStack layers and in the last one:

| index            | "transformers_5" (5.18, 5.24; the default)  | "transformers_4_57" (4.57.0 .. 4.57.6)            |
|------------------|----------------------------------------------|---------------------------------------------------|
| 1 <= i < L       | output of layer i - 1 BEFORE its DeepStack   | output of layer i - 1 AFTER its DeepStack          |
|                  | addition                                     | addition (= the input of layer i)                  |
| L                | the final-normed output (`last_hidden_state`)| the last layer's output BEFORE the final RMSNorm   |

Entries of layers without a DeepStack addition (i - 1 >= Ed) agree. Why 4.57 differs: its
`Qwen3VLTextModel._deepstack_process` adds the DeepStack features in place into the tensor that
`check_model_inputs` has already recorded, and the outermost `Qwen3VLForConditionalGeneration` output has
no `last_hidden_state`, so the raw last-layer entry is not replaced by the normed one; 5.x clones before
the addition and replaces the last entry. Measured against an explicit layer loop by the StarVLA fixtures
(`../shared/fixtures/starvla_qwenpi_v3_tiny/README.md`, `meta.json` `checks.hidden_states_semantics_
transformers_4_57`; `../shared/docs/starvla_native.md` section 5.1). StarVLA pins transformers 4.57.0,
so its QwenPI_v3 blocks read post-DeepStack states and QwenGR00T reads the un-normed last layer.

Both conventions come from the same layer loop: a post-DeepStack entry is the recorded pre-DeepStack
output plus that layer's DeepStack features, the very addition the loop performs (bit for bit).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp

Semantics = Literal["transformers_5", "transformers_4_57"]
SEMANTICS: tuple[str, ...] = ("transformers_5", "transformers_4_57")


def check_semantics(semantics: str) -> None:
    """Raises a one-line ValueError for an unknown convention name."""
    if semantics not in SEMANTICS:
        raise ValueError(f"hidden_states must be one of {SEMANTICS} (the transformers version whose "
                         f"output_hidden_states convention to follow), got {semantics!r}")


def entries(semantics: Semantics, indices, depth: int, *, embeddings: jax.Array, layer_outputs: Mapping[int, jax.Array],
            last: jax.Array, normed: jax.Array, deepstack: jax.Array | None) -> list[jax.Array]:
    """The HF `hidden_states[i]` for each i of `indices` (0..L, L = `depth`), each [B, T, D], under `semantics`.

    Example (L = 3, DeepStack after layers 0 and 1): indices (1, 3) give layer 0's output (plus
    deepstack[0] under "transformers_4_57") and `normed` ("transformers_5") or `last` ("transformers_4_57").

    Args:
      embeddings: [B, T, D] entry 0.
      layer_outputs: layer l -> its output [B, T, D] before any DeepStack addition (the layers l = i - 1
        for every 1 <= i < L asked for).
      last: [B, T, D] the last layer's output (after its DeepStack addition, if it has one), pre final norm.
      normed: [B, T, D] the final-normed output.
      deepstack: [Ed, B, T, D] the features added after layers 0..Ed-1, or None (no images).
    """
    check_semantics(semantics)
    out = []
    for i in indices:
        if i == 0:
            out.append(embeddings)
            continue
        if i == depth:
            out.append(normed if semantics == "transformers_5" else last)
            continue
        h = layer_outputs[i - 1]
        if semantics == "transformers_4_57" and deepstack is not None and i - 1 < deepstack.shape[0]:
            h = h + deepstack[i - 1].astype(h.dtype)
        out.append(h)
    return out


def stack(values: list[jax.Array], like: jax.Array) -> jax.Array:
    """[len(values), B, T, D] (an empty stack shaped after `like` when nothing is asked for)."""
    return jnp.stack(values) if values else jnp.zeros((0,) + like.shape, like.dtype)
