"""Qwen3.5 as a `decoder.LanguageDecoder` (K/V for the full-attention layers, a carry for the linear ones) and as
a `stack.Stack` (`HybridStack`: what `mot` runs for a `ModelSpec` with `hybrid`).

Axes (`oxygen_jax.axes`): Lf full-attention layers, Lg linear (Gated DeltaNet) layers, B rows, T tokens,
Cc conv channels, Kc conv kernel, Hv value heads, Dk / Dv key / value head dims.

    carry = {"window": [Lg, B, Cc, Kc] activation dtype,   the last Kc conv inputs of each linear layer
             "state":  float32 [Lg, B, Hv, Dk, Dv]}         its recurrent (delta-rule) state

The carry's size does not depend on the sequence length. Admission copies a prefix row's carry into the slot
(which is also the reset of a reused slot); a request prompt runs in the chunked form, a decode step in the
recurrent form, and entries with `valid` False are identity steps of the linear layers (padding, inactive
slots): their carry comes back bit for bit.

Speculative verification (`verify`) runs the block (pending token + drafts) in the recurrent form, as a decode
step would, and then must leave the carry at the last *kept* entry. It re-runs the kept part rather than
keeping per-position states: the kept entries, with the rest marked invalid (identity steps), give exactly
that carry, and the re-run is skipped (one `lax.cond`) when every row kept its whole block, the common case
when drafts are right. Per-position states would cost γ + 1 copies of the fixed state per slot (at
Qwen3.5-0.8B about 19 MB of float32 recurrent state per slot and draft token) and a state-selecting hook in
every linear layer; the re-run costs one more pass only when a draft was rejected.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.models.backbone import BackboneSpec, Decoder
from oxygen_jax.models.decoder import LanguageDecoder
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.models.qwen35.model import Qwen35Spec
from oxygen_jax.models.stack import Stack
from oxygen_jax.nn import kv_quant

_STATIC = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridDecoder(LanguageDecoder):
    """Qwen3.5's decoder (`qwen35.decoder_tree` weights) with its static `Qwen35Spec` and default stop ids.

    Per-row adapters: a `qwen35.HybridBank` (both layer kinds).
    """

    decoder: Decoder
    spec: Qwen35Spec = dataclasses.field(metadata=_STATIC)
    stop_ids: tuple[int, ...] = dataclasses.field(default=(), metadata=_STATIC)

    @property
    def backbone(self) -> BackboneSpec:
        return self.spec.backbone

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return self.spec.full_layers

    @property
    def kv_caches(self) -> tuple[kv_quant.KVCache, ...]:
        return kv_quant.KV_CACHES  # the full layers' K/V go through `kv_quant.write_layer` (`forward_step`)

    def init_carry(self, num_slots: int) -> dict[str, jax.Array]:
        window, state = qwen35.empty_state(self.spec, num_slots, self.dtype)
        return dict(window=window, state=state)

    def _carry_rows(self, prefix: Prefix, rows: jax.Array) -> dict[str, jax.Array]:
        if prefix.window is None or prefix.state is None:
            raise ValueError("a Qwen3.5 language model decodes from a prefix with its linear layers' window and state: "
                             "build it with models.qwen35.model.prefix_pass(..., language=True)")
        return dict(window=prefix.window[:, rows], state=prefix.state[:, rows])

    def _forward(self, form, x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora):
        h, kv, (window, state) = qwen35.forward_step(self.spec, self.decoder.layers, x, positions, valid, mask, cache_k,
                                                     cache_v, write_index, carry["window"], carry["state"], form=form,
                                                     lora=lora)
        return h, kv, dict(window=window, state=state)

    def extend(self, x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora):
        return self._forward("chunked", x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora)

    def step(self, x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora):
        return self._forward("recurrent", x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora)

    def verify(self, x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora, judge):
        h, kv, after = self._forward("recurrent", x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora)
        keep, out = judge(h)
        kept = valid & (jnp.arange(x.shape[1])[None, :] < keep[:, None])
        no_write = jnp.full_like(write_index, cache_k.shape[2])  # the K/V are already written

        def rerun(_):
            return self._forward("recurrent", x, positions, kept, mask, *kv, no_write, carry, lora)[2]

        carry = jax.lax.cond(jnp.all(kept == valid), lambda _: after, rerun, None)
        return out, kv, carry

    def check_bank(self, bank) -> None:
        if bank is not None:
            qwen35.check_bank(self.spec, bank)


def language_model(spec: Qwen35Spec, decoder: Decoder, stop_ids: tuple[int, ...] = ()) -> HybridDecoder:
    """The decoder as what `runtime.decode` serves."""
    return HybridDecoder(decoder=decoder, spec=spec, stop_ids=tuple(stop_ids))


@dataclasses.dataclass(frozen=True)
class HybridStack(Stack):
    """Qwen3.5's layer stack as `mot` runs it: K/V in the full-attention layers only, a recurrent state in the
    linear ones (which is why a prompt's valid tokens must be contiguous and no head may read K/V)."""

    spec: Qwen35Spec

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return self.spec.full_layers

    def check_heads(self, backbone: BackboneSpec, heads) -> None:
        if backbone != self.spec.backbone:
            raise ValueError("ModelSpec.backbone must be hybrid.backbone for a Qwen3.5 model")
        kv = [h.name for h in heads if h.kv_layers]
        if kv:
            raise ValueError(f"heads {kv} read K/V, which Qwen3.5's linear-attention layers do not have: use heads "
                             f"that read hidden states (QwenPI_v3, GR00T)")

    def check_mask(self, mask: np.ndarray) -> None:
        # A recurrent state cannot skip a token: each row's valid tokens in one run.
        starts = np.sum(np.diff(np.pad(mask, [(0, 0), (1, 0)]).astype(np.int8), axis=-1) == 1, axis=-1)
        bad = np.flatnonzero(starts > 1).tolist()
        if bad:
            raise ValueError(f"rows {bad} have invalid tokens between valid ones, which Qwen3.5's linear layers "
                             f"cannot mask: left-pad them (models.qwen35.model.compact_left)")

    def init(self, seed: int, dtype: str) -> Decoder:
        return qwen35.init_decoder(self.spec, seed, dtype)

    def abstract(self, dtype: str) -> Decoder:
        return qwen35.abstract_decoder(self.spec, dtype)

    def lay_out(self, layers, cpu: bool):
        """As they are on every backend: the stack is its own scan over layer groups."""
        return layers

    def prefix_pass(self, decoder, x, positions, input_mask, next_position, *, kv_layers, hidden_layers, last_hidden,
                    deepstack=None) -> Prefix:
        # Qwen3.5's ViT has no DeepStack (`deepstack` stays None); with language the full layers' K/V are kept,
        # which is `kv_layers` (no head reads K/V: `check_heads`).
        return qwen35.prefix_pass(self.spec, decoder, x, positions, input_mask, next_position,
                                  hidden_layers=hidden_layers, language=last_hidden)

    def language_model(self, decoder: Decoder, stop_ids: tuple[int, ...]) -> HybridDecoder:
        return language_model(self.spec, decoder, stop_ids)
