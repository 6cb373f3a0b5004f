"""The layer-stack interface: what `mot` asks of a backbone's decoder stack, and its attention-only kind.

Axes (`oxygen_jax.axes`): B batch, P prefix tokens, D width, Lk layers with K/V, Lh kept hidden states,
K KV heads, H head dim; Mr = 3 M-RoPE axes.

A `ModelSpec` chooses its stack once (`ModelSpec.stack`); mot then calls only:

    kv_layers                          the layers with K/V (what the decode pool continues)
    check_heads(backbone, heads)       one-line ValueError for a spec the stack cannot run
    check_mask(mask)                   host check of a prompt mask (`mot.make_inputs`)
    init(seed, dtype), abstract(dtype) the decoder's weights (random draws, or shapes only)
    lay_out(layers, cpu)               the decoder's layer weights laid out for a backend (`mot.for_backend`)
    prefix_pass(decoder, x, ...)       the embedded prompt through every layer, as a `Prefix`
    language_model(decoder, stop_ids)  the stack as a `decoder.LanguageDecoder`

Two kinds: `AttentionStack` here (every layer attends: Gemma, Qwen3, Qwen3-VL) and
`qwen35_decoder.HybridStack` (Qwen3.5: Gated DeltaNet layers between full-attention ones).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from oxygen_jax.models import backbone as bb
from oxygen_jax.models.backbone import BackboneSpec, Decoder
from oxygen_jax.models.decoder import AttentionDecoder, LanguageDecoder
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import stack_layers, unstack_layers
from oxygen_jax.nn.masks import last_valid_index


class Stack:
    """The interface (see the module docstring). Subclasses are frozen dataclasses of static specs."""

    @property
    def kv_layers(self) -> tuple[int, ...]:
        raise NotImplementedError

    def check_heads(self, backbone: BackboneSpec, heads) -> None:
        """One-line ValueError when `backbone` is not this stack's or a head (`HeadSpec`) reads what it lacks."""
        raise NotImplementedError

    def check_mask(self, mask: np.ndarray) -> None:
        """One-line ValueError when bool [B, P] prompt masks have a pattern this stack cannot mask."""
        raise NotImplementedError

    def init(self, seed: int, dtype: str) -> Decoder:
        raise NotImplementedError

    def abstract(self, dtype: str) -> Decoder:
        raise NotImplementedError

    def lay_out(self, layers, cpu: bool):
        """`Decoder.layers` in the layout this stack runs fastest on a backend (`cpu`: XLA's CPU backend, else an
        accelerator); the same weights, a no-op when they are laid out so already."""
        raise NotImplementedError

    def prefix_pass(self, decoder: Decoder, x, positions, input_mask, next_position, *, kv_layers: tuple[int, ...],
                    hidden_layers: tuple[int, ...], last_hidden: bool, deepstack=None) -> Prefix:
        """Embedded prompts x [B, P, D] through every layer, keeping only what is read.

        Args:
          positions: int32 [B, P] or [Mr, B, P]; input_mask bool [B, P]; next_position int32 [B];
          kv_layers, hidden_layers: the K/V and HF hidden-state indices to keep; last_hidden: keep the last valid
            token's final-normed output [B, D]; deepstack: image features added to the first layers, or None.
        Returns:
          `Prefix` with K/V [Lk, B, P, K, H], hidden [Lh, B, P, D], the mask, positions and `last_hidden`.
        """
        raise NotImplementedError

    def language_model(self, decoder: Decoder, stop_ids: tuple[int, ...]) -> LanguageDecoder:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class AttentionStack(Stack):
    """Every layer attends and keeps K/V (`backbone.Decoder` layers)."""

    backbone: BackboneSpec

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return tuple(range(self.backbone.depth))

    def check_heads(self, backbone: BackboneSpec, heads) -> None:
        """Any head: every layer has K/V and hidden states."""

    def check_mask(self, mask: np.ndarray) -> None:
        """Any pattern: masked entries are never attended to."""

    def init(self, seed: int, dtype: str) -> Decoder:
        return bb.init_decoder(self.backbone, seed, dtype)

    def abstract(self, dtype: str) -> Decoder:
        return bb.abstract_decoder(self.backbone, dtype)

    def lay_out(self, layers, cpu: bool):
        """Per-layer buffers on the CPU, one stack elsewhere (`nn.layers.scan_layers`)."""
        return unstack_layers(layers) if cpu else stack_layers(layers)

    def prefix_pass(self, decoder, x, positions, input_mask, next_position, *, kv_layers, hidden_layers, last_hidden,
                    deepstack=None) -> Prefix:
        # The layer loop stores only the K/V and hidden states someone reads (the others are never kept).
        out = bb.prefill(self.backbone, decoder, x, positions, input_mask, deepstack=deepstack, keep_kv=kv_layers,
                         keep_hidden=hidden_layers)
        k = v = hidden = last = None
        if kv_layers:
            k, v = out["k"], out["v"]
        if hidden_layers:
            hidden = out["hidden_states"]
        if last_hidden:
            idx = last_valid_index(input_mask)
            last = jnp.take_along_axis(out["normed"], idx[:, None, None], axis=1)[:, 0]
        return Prefix(k=k, v=v, hidden=hidden, mask=input_mask, positions=positions,
                      next_position=next_position.astype(jnp.int32), last_hidden=last, kv_layers=kv_layers,
                      hidden_layers=hidden_layers, rope=self.backbone.rope)

    def language_model(self, decoder: Decoder, stop_ids: tuple[int, ...]) -> LanguageDecoder:
        return AttentionDecoder(decoder=decoder, spec=self.backbone, stop_ids=stop_ids)
