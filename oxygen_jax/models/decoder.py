"""The language-decoder interface: what a decode slot pool needs of a language model, and its attention-only kind.

Axes (`oxygen_jax.axes`): Lk layers with K/V, J rows (requests), P prefix tokens, Q request-prompt tokens,
T tokens in one pass, Ns slots, C slot capacity, K KV heads, H head dim, D width, V vocabulary.

A `LanguageDecoder` is a registered pytree (weights as leaves, spec and stop ids static) that continues the
rows of a `prefix.Prefix`. The pool (`runtime.decode`) keeps slot bookkeeping only and calls:

    kv_layers, num_kv_heads, head_dim, dtype   the shape of a slot's K/V [Lk, Ns, C, K, H]
    kv_caches, check_kv_cache, init_kv         the K/V storages it takes (`nn.kv_quant`: float, int8, fp8),
                                               the refusal of others, a pool's empty K/V in one of them
    init_carry(Ns)                             per-slot state beside the K/V (a dict of leaves whose slot
                                               axis is 1: [layers, Ns, ...]), or None / {} when there is none
    rows(prefix, rows)                         what admission copies from the prefix rows (`PrefixRows`)
    extend(...)                                T tokens after cached ones (the request prompt, in the
                                               form that runs many tokens at once)
    step(...)                                  one token per slot (the decode step)
    verify(..., judge)                         a block of T tokens per slot (pending token + draft) that
                                               keeps only a judged prefix of it (speculative decoding)
    embed, final_norm, logits_vocab_major      token embedding, the final norm, the head
    prompt_pass(view, tokens, lengths, ...)    request prompts after gathered prefix rows (shared, on `extend`)
    suffix_forward(prefix, rows, tokens, ...)  the same pass from a `Prefix`: the teacher-forced training loss
    check_bank(bank)                           the kind of per-row adapter bank this decoder serves
    stop_ids, vocab_size                       the default stop set and the vocabulary

Two kinds implement it: `AttentionDecoder` here (Gemma as π0.5's VLM expert, Qwen3, Qwen3-VL: every layer
has K/V and no other state) and `models.qwen35.decoder.HybridDecoder` (Qwen3.5: K/V of the full-attention
layers, plus each linear layer's conv window and recurrent state as the carry). A family supplies its view
(`pi05.model.language_model`, `mot.language_model`); nothing above the models floor asks which kind it holds.

Quantized K/V (`nn.kv_quant.QuantKV`): a decoder whose every K/V write and read goes through
`kv_quant.write_layer` (both kinds here: `backbone.forward_write`, Qwen3.5's `forward_step`) lists the three
storages in `kv_caches`; caches then arrive at `extend` / `step` / `verify` as float arrays or `QuantKV`s alike.

`extend` and `step` take `valid` (bool [B, T]: entries that advance the sequence) beside the cache mask:
attention layers need only the mask (a padding entry is computed but never attended to), recurrent layers
run invalid entries as identity steps so the carry ends at the last valid token.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone
from oxygen_jax.models.backbone import BackboneSpec, Decoder
from oxygen_jax.models.lora import LoraBank, RowAdapters
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn import kv_quant

_STATIC = dict(static=True)

MAX_STOP_IDS = 8
"""The most stop ids one request carries (a static width: `runtime.decode.Sampling.stop_ids` is [n, 8])."""


class PrefixRows(NamedTuple):
    """What admission reads from J prefix rows (gathered: row j is the request's own prefix row).

    k, v [Lk, J, P, K, H] (float; in a quantized pool's storage once admission converts them, `kv_quant.like`);
    mask bool [J, P]; next_position int32 [J] (RoPE position of the first entry after
    the prefix); last_hidden [J, D] (final-normed, the first token's logits); carry: the decoder's state
    beyond K/V at the last valid prefix token (leaves [layers, J, ...]), or None.
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    next_position: jax.Array
    last_hidden: jax.Array
    carry: dict[str, jax.Array] | None


def check_stop_ids(stop_ids, vocab_size: int) -> tuple[int, ...]:
    """The stop ids as a sorted tuple of distinct ints in [0, V); one-line ValueError otherwise."""
    ids = tuple(sorted({int(i) for i in stop_ids}))
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(ids)}")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"stop id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


class LanguageDecoder:
    """The interface (see the module docstring). Subclasses are registered dataclasses with the fields
    `decoder` (weights), `spec` (static) and `stop_ids` (static tuple)."""

    decoder: Decoder
    stop_ids: tuple[int, ...]

    # -- shape facts ---------------------------------------------------------------------------

    @property
    def backbone(self) -> BackboneSpec:
        """The spec of the embedder, norms and head (and of the attention layers)."""
        raise NotImplementedError

    @property
    def kv_layers(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def num_kv_heads(self) -> int:
        return self.backbone.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.backbone.head_dim

    @property
    def vocab_size(self) -> int:
        return self.backbone.vocab_size

    @property
    def dtype(self) -> jnp.dtype:
        return self.decoder.embedding.dtype

    @property
    def kv_caches(self) -> tuple[kv_quant.KVCache, ...]:
        """The K/V storages this decoder's attention writes and reads (a decoder that stores K/V by itself: float)."""
        return ("float",)

    def check_kv_cache(self, kv_cache) -> None:
        """One-line ValueError when `kv_cache` is no storage, or one this decoder cannot take."""
        if kv_quant.check_kv_cache(kv_cache) not in self.kv_caches:
            raise ValueError(f"{type(self).__name__} stores K/V as {', '.join(self.kv_caches)} only, not {kv_cache}: "
                             "serve it with kv_cache='float'")

    def init_kv(self, num_slots: int, capacity: int, kv_cache: kv_quant.KVCache = "float"):
        """Zeroed slot K/V (k, v), each [Lk, Ns, C, K, H] in the decoder's dtype or a `kv_quant.QuantKV`
        (`check_kv_cache` first)."""
        self.check_kv_cache(kv_cache)
        shape = (len(self.kv_layers), num_slots, capacity, self.num_kv_heads, self.head_dim)
        return kv_quant.zeros(shape, self.dtype, kv_cache), kv_quant.zeros(shape, self.dtype, kv_cache)

    def init_carry(self, num_slots: int) -> dict[str, jax.Array] | None:
        """Zeroed per-slot state beyond K/V, leaves [layers, Ns, ...]; None when the decoder has none."""
        return None

    # -- admission -----------------------------------------------------------------------------

    def rows(self, prefix: Prefix, rows: jax.Array) -> PrefixRows:
        """The prefix rows `rows` (int32 [J]) as admission copies them; one-line ValueError when the
        prefix did not keep what this decoder continues from."""
        if prefix.kv_layers != self.kv_layers or prefix.last_hidden is None:
            raise ValueError(f"language decoding needs the K/V of layers {self.kv_layers} and the last hidden state, "
                             f"but the prefix kept K/V of layers {prefix.kv_layers}: build it with a ModelSpec that "
                             "has language=True")
        return PrefixRows(prefix.k[:, rows], prefix.v[:, rows], prefix.mask[rows], prefix.next_position[rows],
                          prefix.last_hidden[rows], self._carry_rows(prefix, rows))

    def _carry_rows(self, prefix: Prefix, rows: jax.Array) -> dict[str, jax.Array] | None:
        return None

    # -- the forward passes --------------------------------------------------------------------

    def extend(self, x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora: RowAdapters | None):
        """T tokens after cached entries, all at once (a request prompt).

        Args:
          x: [B, T, D] embeddings; positions int [B, T]; valid bool [B, T]; mask bool [B, T, S] over the
            cache entries; cache_k, cache_v [Lk, B, S, K, H]; write_index int [B, T] (>= S: no write);
          carry: the rows' carry or None; lora: per-row adapters or None.
        Returns:
          (hidden [B, T, D] before the final norm, (cache_k, cache_v), carry).
        """
        raise NotImplementedError

    def step(self, x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora: RowAdapters | None):
        """One token per row ([B, 1, ...] arguments as `extend`); rows with `valid` False leave their carry
        unchanged, bit for bit."""
        raise NotImplementedError

    def verify(self, x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora: RowAdapters | None, judge):
        """Scores a block of T tokens per row in the decode step's arithmetic, then keeps a prefix of it.

        Arguments as `extend` (T = γ + 1: the pending token and up to γ draft tokens, `mask` causal inside the
        block). `judge(hidden [B, T, D] before the final norm) -> (keep int32 [B], out)` decides from the
        block's hidden states how many leading entries each row keeps (0 <= keep <= its valid entries).
        Returns (out, (cache_k, cache_v), carry) with the carry at each row's entry keep - 1 (unchanged
        where keep = 0). K/V of entries past `keep` may be written: the pool never unmasks them, and a
        later step overwrites them (roll-back by position).
        """
        raise NotImplementedError

    # -- embedder, norm, head ------------------------------------------------------------------

    def embed(self, tokens: jax.Array) -> jax.Array:
        """int32 [...] -> [..., D] in the decoder's dtype."""
        return backbone.embed_tokens(self.backbone, self.decoder, tokens).astype(self.dtype)

    def final_norm(self, hidden: jax.Array) -> jax.Array:
        return backbone.final_norm(self.backbone, self.decoder, hidden)

    def logits_vocab_major(self, hidden: jax.Array) -> jax.Array:
        """Final-normed [B, D] -> float32 [V, B]."""
        return backbone.lm_logits_vocab_major(self.backbone, self.decoder, hidden)

    def check_bank(self, bank) -> None:
        """One-line ValueError when `bank` is not the kind of adapter bank this decoder serves (None: fine)."""
        raise NotImplementedError

    # -- the suffix pass: decoder maths with no slot state --------------------------------------

    def prompt_pass(self, view: PrefixRows, tokens, lengths, bank, adapter):
        """The request prompts after their prefix rows: (k, v [Lk, J, P + Q, K, H], hidden [J, Q, D] before the
        final norm, carry at each row's last real entry).

        tokens int32 [J, Q]; lengths int32 [J]: entries >= a row's length are padding (attention layers compute
        them unseen, recurrent layers run them as identity steps); bank, adapter: adapter bank or None, int32 [J].
        """
        ck, cv, x, positions, mask, write = _prompt_inputs(self, view, tokens)
        real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        lora = row_adapters(bank, adapter)
        h, (ck, cv), carry = self.extend(x, positions, real, mask, ck, cv, write, view.carry, lora)
        return ck, cv, h, carry

    def suffix_forward(self, prefix: Prefix, rows: jax.Array, tokens: jax.Array, bank=None,
                       adapter: jax.Array | None = None):
        """Runs suffix tokens causally after prefix rows through the language model: the request-prompt pass.

        This is the one forward of a request's own tokens: the slot pool's admission runs it on request
        prompts, and the memory-LoRA training runs it teacher-forced on [prompt | answer], so a trained adapter
        sees exactly the computation it is served with.

        Args:
          prefix: a `Prefix` with the K/V (and carry) the decoder continues.
          rows: int32 [J] prefix row each sequence continues.
          tokens: int32 [J, Q] suffix tokens, all real.
          bank, adapter: optional adapter bank and int32 [J] adapter ids (0 = base weights).
        Returns:
          (k, v [Lk, J, P + Q, K, H]: the prefix rows followed by the suffix, hidden [J, Q, D] before the
          final norm).
        """
        self.check_bank(bank)
        adapter = jnp.zeros((rows.shape[0],), jnp.int32) if adapter is None else adapter
        lengths = jnp.full((rows.shape[0],), tokens.shape[1], jnp.int32)
        ck, cv, h, _ = self.prompt_pass(self.rows(prefix, rows), tokens, lengths, bank, adapter)
        return ck, cv, h

    def with_stop_ids(self, stop_ids) -> LanguageDecoder:
        """The same decoder with another default stop set (checked against the vocabulary)."""
        return dataclasses.replace(self, stop_ids=check_stop_ids(stop_ids, self.vocab_size))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionDecoder(LanguageDecoder):
    """A transformer whose every layer attends (Gemma, Qwen3, Qwen3-VL): the carry is empty.

    Attributes:
      decoder: `backbone.Decoder` (embedder, layers, final norm, optional untied head).
      spec: its `BackboneSpec` (static).
      stop_ids: the default stop set (static; e.g. π0.5's EOS, a Qwen checkpoint's `eos_token_id` list).
    """

    decoder: Decoder
    spec: BackboneSpec = dataclasses.field(metadata=_STATIC)
    stop_ids: tuple[int, ...] = dataclasses.field(default=(), metadata=_STATIC)

    @property
    def backbone(self) -> BackboneSpec:
        return self.spec

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return tuple(range(self.spec.depth))

    @property
    def kv_caches(self) -> tuple[kv_quant.KVCache, ...]:
        return kv_quant.KV_CACHES  # `backbone.forward_write` stores and reads through `kv_quant.write_layer`

    def extend(self, x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora):
        h, kv = backbone.forward_write(self.spec, self.decoder.layers, x, positions, mask, cache_k, cache_v, write_index,
                                       lora=lora)
        return h, kv, carry

    step = extend

    def verify(self, x, positions, valid, mask, cache_k, cache_v, write_index, carry, lora, judge):
        # Attention keeps no state besides K/V, which roll back by position: one pass, nothing to select.
        h, kv = backbone.forward_write(self.spec, self.decoder.layers, x, positions, mask, cache_k, cache_v, write_index,
                                       lora=lora)
        _, out = judge(h)
        return out, kv, carry

    def check_bank(self, bank) -> None:
        if bank is not None and not isinstance(bank, LoraBank):
            raise ValueError(f"this attention decoder serves a lora.LoraBank, got {type(bank).__name__} "
                             "(a qwen35.HybridBank serves Qwen3.5 language models only)")


def _prompt_inputs(lm: LanguageDecoder, view: PrefixRows, tokens):
    """Slot caches [Lk, J, P + Q, K, H] (prefix rows, then room for Q entries; float or `QuantKV`), embedded
    tokens [J, Q, D],
    positions [J, Q], mask [J, Q, P + Q] (prefix validity, causal suffix) and write index [J, Q]."""
    j, q_cap, p = tokens.shape[0], tokens.shape[1], view.mask.shape[-1]
    pad = [(0, 0), (0, 0), (0, q_cap), (0, 0), (0, 0)]
    ck, cv = jax.tree.map(lambda a: jnp.pad(a, pad), (view.k, view.v))
    steps = jnp.arange(q_cap, dtype=jnp.int32)
    causal = steps[None, :] <= steps[:, None]  # [Q, Q]
    mask = jnp.concatenate(
        [jnp.broadcast_to(view.mask[:, None, :], (j, q_cap, p)), jnp.broadcast_to(causal, (j, q_cap, q_cap))], -1
    )
    positions = view.next_position[:, None] + steps[None]  # equal on all M-RoPE axes
    return ck, cv, lm.embed(tokens), positions, mask, jnp.broadcast_to(p + steps, (j, q_cap))


def row_adapters(bank, ids: jax.Array) -> RowAdapters | None:
    """The per-row adapter argument of `extend` / `step`, or None (the adapter-free program) without a bank."""
    return None if bank is None else RowAdapters(bank, ids)


def carry_rows(carry: dict[str, jax.Array] | None, rows: jax.Array) -> dict[str, jax.Array] | None:
    """Rows of a carry (leaves [layers, B, ...] -> [layers, J, ...])."""
    return None if carry is None else {name: leaf[:, rows] for name, leaf in carry.items()}
