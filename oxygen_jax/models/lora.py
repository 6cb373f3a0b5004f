"""LoRA adapters of one layer stack as pytrees: shapes, merging into the weights, and banks served per row.

Axes (`oxygen_jax.axes`): L layers, E adapters stored in a bank, B batch rows, T tokens, Y = B*T
flattened rows, D expert width, F MLP hidden, N query heads, K KV heads, 2 the K/V or gate/up pair,
H head dim, r LoRA rank. A and B are the two LoRA factors, not axes.

openpi's LoRA (`src/openpi/models/lora.py`), reproduced exactly (checked against the shared
`openpi_tiny_pi05_lora` fixture, whose merged weights this module reproduces):

* attention einsums (`q_einsum`, `kv_einsum`, `attn_vec_einsum`): `y = x·W + s·((x·A)·B)` with
  s = alpha / rank (alpha / sqrt(rank) with rslora). A replaces W's last axis by r, B replaces
  its second-to-last axis by r:

      target  W              A              B              effective update
      q       [N, D, H]      [N, D, r]      [N, r, H]      ΔW[n] = s·A[n]·B[n]          (per head)
      kv      [2, K, D, H]   [2, K, D, r]   [2, K, r, H]   ΔW[c,k] = s·A[c,k]·B[c,k]
      out     [N, H, D]      [N, H, r]      [N, r, D]      ΔW[n] = s·A[n]·Σ_m B[m]      (!)

  `out` (attn_vec) contracts heads in both factors ("BTNH,NHr->BTr", then "BTr,NrD->BTD"), so
  only the head-sum of its B matters.
* feed-forward (`gating_einsum` = [gate; up], `linear`): `y = x·W + (x·A)·B`, NOT scaled, whatever
  alpha and rank are:

      gating  [2, D, F]      [2, D, r]      [2, r, F]      ΔW[c] = A[c]·B[c]
      linear  [F, D]         [F, r]         [r, D]         ΔW = A·B

* A and B are cast to the activation dtype; the LoRA product is added after the base product.
* openpi initialises A and B with normal(0.01), so a fresh openpi adapter is not the identity;
  `pi05.lora.init_bank` (for adapters trained here) uses B = 0 instead.

alpha is not stored in checkpoints. openpi's shipped variants (`gemma_2b_lora`: rank 16,
`gemma_300m_lora`: rank 32) use alpha = rank, i.e. s = 1; pass the alpha a checkpoint was trained
with when it differs. Only the attention LoRA depends on it.

Pytrees (leaves are arrays; alpha and rslora are static):

* `ExpertLora` — one adapter of one expert (a layer stack), leaves as openpi stores them (leading
  L axis), or without the L axis for one layer. Targets without LoRA are None.
* `LoraBank` — E adapters of one expert, every leaf stacked on axis 1: [L, E, ...]. The layer
  loop slices axis 0 (scan or unrolled), leaving [E, ...] per layer. Adapter id n in 1..E is bank
  index n - 1; id 0 means the base weights and is not stored, so a bank of E adapters serves the
  ids 0..E. Ids outside 0..E get the base weights.
* `RowAdapters(bank, ids)` — the `lora` argument of `backbone.forward_write`: one adapter id per row.

* `DeltaNetLora` — one adapter of Qwen3.5's Gated DeltaNet (linear-attention) layers, the same
  conventions on their projections (C = Cc conv channels, A = Hv value heads, Z = Dv value head dim;
  `models/qwen35/gated_deltanet.py`). The mixer targets are scaled like attention, the MLP is unscaled:

      target  W              A              B              effective update
      qkv     [D, C]         [D, r]         [r, C]         ΔW = s·A·B      (in_proj_qkv)
      z       [D, A, Z]      [D, r]         [r, A, Z]      ΔW = s·A·B      (in_proj_z, the output gate)
      out     [A, Z, D]      [A, Z, r]      [r, D]         ΔW = s·A·B      (out_proj; no head sum)
      gating  [2, D, F]      [2, D, r]      [2, r, F]      ΔW[c] = A[c]·B[c]
      linear  [F, D]         [F, r]         [r, D]         ΔW = A·B

  in_proj_b / in_proj_a ([D, Hv] gate logits) and the conv are not targets. Qwen3.5's bank of both
  layer kinds, grouped as its layer scan, is `models.qwen35.model.HybridBank`.

Shapes come from `LayerDims`, read off a stack's weights (`layer_dims`); `DeltaNetDims` for the
linear layers. π0.5's two-expert adapters
(`ModelLora`, `merge`, `init_bank`, `stack_adapters`) are in `models/pi05/lora.py`; openpi's
checkpoint paths of the factors in `ckpts/openpi_lora.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from oxygen_jax.nn.layers import Unstacked

TARGETS = ("q", "kv", "out", "gating", "linear")
"""LoRA targets, named after the layer weights they update (`backbone.DecoderLayers`' fields)."""
ATTN_TARGETS = ("q", "kv", "out")
"""Targets scaled by alpha / rank (openpi's attention einsums)."""
FFN_TARGETS = ("gating", "linear")
"""Targets added unscaled (openpi's feed-forward LoRA)."""
DELTANET_TARGETS = ("qkv", "z", "out", "gating", "linear")
"""LoRA targets of a Gated DeltaNet layer (`gated_deltanet.GatedDeltaNetLayers`' fields)."""
DELTANET_MIXER_TARGETS = ("qkv", "z", "out")
"""Gated DeltaNet targets scaled by alpha / rank (they replace attention's q, kv, out)."""


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


_STATIC = dict(static=True)


@_pytree
class LoraPair:
    """The two factors of one target: `a` [..., in, r], `b` [..., r, out] (openpi's lora_a / lora_b)."""

    a: jax.Array
    b: jax.Array


class _Targeted:
    """What ExpertLora and DeltaNetLora share: `_targets` (all) and `_scaled` (those scaled by
    alpha / rank; they share one rank, as the FFN targets do)."""

    _targets: tuple[str, ...] = ()
    _scaled: tuple[str, ...] = ()

    def pairs(self) -> dict[str, LoraPair]:
        """{target: pair} for the targets that have LoRA."""
        return {t: getattr(self, t) for t in self._targets if getattr(self, t) is not None}

    def _rank(self, targets) -> int | None:
        pair = next((getattr(self, t) for t in targets if getattr(self, t) is not None), None)
        return None if pair is None else int(pair.a.shape[-1])

    @property
    def ffn_rank(self) -> int | None:
        return self._rank(FFN_TARGETS)

    @property
    def scaling(self) -> float:
        """The scaled targets' alpha / rank (alpha / sqrt(rank) with rslora); 1.0 when there are none."""
        rank = self._rank(self._scaled)
        if rank is None:
            return 1.0
        return self.alpha / math.sqrt(rank) if self.rslora else self.alpha / rank


@_pytree
class ExpertLora(_Targeted):
    """One LoRA adapter of one expert's layer stack (shapes in the module docstring, plus a leading L).

    Attributes:
      q, kv, out, gating, linear: `LoraPair` or None where the target has no LoRA.
      alpha: attention scaling numerator (static); the feed-forward LoRA ignores it.
      rslora: scaling alpha / sqrt(rank) instead of alpha / rank (static).
    """

    q: LoraPair | None
    kv: LoraPair | None
    out: LoraPair | None
    gating: LoraPair | None
    linear: LoraPair | None
    alpha: float = dataclasses.field(metadata=_STATIC)
    rslora: bool = dataclasses.field(default=False, metadata=_STATIC)

    _targets, _scaled = TARGETS, ATTN_TARGETS  # scaling = openpi's `scaling_value`

    @property
    def attn_rank(self) -> int | None:
        return self._rank(ATTN_TARGETS)

    def replace(self, **changes) -> "ExpertLora":
        return dataclasses.replace(self, **changes)


@_pytree
class DeltaNetLora(_Targeted):
    """One LoRA adapter of Gated DeltaNet layers (shapes in the module docstring, after any leading axes).

    Attributes:
      qkv, z, out, gating, linear: `LoraPair` or None where the target has no LoRA.
      alpha: scaling numerator of the mixer targets (static); the MLP LoRA ignores it.
      rslora: alpha / sqrt(rank) instead of alpha / rank (static).
    """

    qkv: LoraPair | None
    z: LoraPair | None
    out: LoraPair | None
    gating: LoraPair | None
    linear: LoraPair | None
    alpha: float = dataclasses.field(metadata=_STATIC)
    rslora: bool = dataclasses.field(default=False, metadata=_STATIC)

    _targets, _scaled = DELTANET_TARGETS, DELTANET_MIXER_TARGETS


@_pytree
class LoraBank:
    """E adapters of one expert for per-row serving: `adapters` leaves are [L, E, ...openpi shape
    without L]. Adapter id n (1..E) is `adapters[:, n - 1]`; id 0 = base weights, not stored."""

    adapters: ExpertLora

    @property
    def num_adapters(self) -> int:
        return int(jax.tree.leaves(self.adapters)[0].shape[1])

    def adapter(self, adapter_id: int) -> ExpertLora:
        """The stored adapter with id `adapter_id` (1..E), leaves [L, ...]."""
        if not 1 <= adapter_id <= self.num_adapters:
            raise ValueError(f"adapter id {adapter_id} is not stored in this bank (ids 1..{self.num_adapters}; 0 = base)")
        return _take_adapter(self.adapters, adapter_id - 1)


@jax.jit
def _take_adapter(adapters: ExpertLora, index) -> ExpertLora:
    return jax.tree.map(lambda x: x[:, index], adapters)


@_pytree
class RowAdapters:
    """Per-row adapters for `backbone.forward_write`.

    Attributes:
      bank: the adapters of the expert being run (leaves [L, E, ...]).
      ids: int32 [B] adapter id of each row: 0 = base weights, n = bank adapter n (1..E).
    """

    bank: LoraBank
    ids: jax.Array


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


class LayerDims(NamedTuple):
    """The dims of a layer stack that LoRA shapes depend on."""

    width: int  # D
    depth: int  # L
    mlp_dim: int  # F
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H


def layer_dims(layers) -> LayerDims:
    """The dims read off a stack's weights (stacked [L, ...] or `Unstacked`): q [N, D, H], kv [2, K, D, H], gating [2, D, F]."""
    if isinstance(layers, Unstacked):
        depth, first = len(layers.layers), layers.layers[0]
        n, d, h = first.q.shape
        k, f = first.kv.shape[1], first.gating.shape[-1]
    else:
        depth, n, d, h = layers.q.shape
        k, f = layers.kv.shape[2], layers.gating.shape[-1]
    return LayerDims(width=d, depth=depth, mlp_dim=f, num_heads=n, num_kv_heads=k, head_dim=h)


def target_shapes(dims: LayerDims, target: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A shape, B shape) of one target for one layer (no L axis)."""
    d, f, n, k, h = dims.width, dims.mlp_dim, dims.num_heads, dims.num_kv_heads, dims.head_dim
    return {
        "q": ((n, d, rank), (n, rank, h)),
        "kv": ((2, k, d, rank), (2, k, rank, h)),
        "out": ((n, h, rank), (n, rank, d)),
        "gating": ((2, d, rank), (2, rank, f)),
        "linear": ((f, rank), (rank, d)),
    }[target]


class DeltaNetDims(NamedTuple):
    """The dims of Gated DeltaNet layers that LoRA shapes depend on."""

    width: int  # D
    mlp_dim: int  # F
    conv_channels: int  # Cc = 2 Hk Dk + Hv Dv
    num_value_heads: int  # Hv
    value_dim: int  # Dv


def deltanet_target_shapes(dims: DeltaNetDims, target: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A shape, B shape) of one Gated DeltaNet target for one layer (no leading axes)."""
    d, f, c, a, z = dims.width, dims.mlp_dim, dims.conv_channels, dims.num_value_heads, dims.value_dim
    return {
        "qkv": ((d, rank), (rank, c)),
        "z": ((d, rank), (rank, a, z)),
        "out": ((a, z, rank), (rank, d)),
        "gating": ((2, d, rank), (2, rank, f)),
        "linear": ((f, rank), (rank, d)),
    }[target]


def _leaf_shapes(adapter: ExpertLora | DeltaNetLora) -> dict[str, tuple]:
    out = {}
    for target, pair in adapter.pairs().items():
        out[f"{target}.a"], out[f"{target}.b"] = tuple(pair.a.shape), tuple(pair.b.shape)
    return out


def _mismatches(got: dict[str, tuple], want: dict[str, tuple]) -> list[str]:
    lines = [f"{k}: expected {want[k]}, got {got[k]}" for k in want if k in got and got[k] != want[k]]
    lines += [f"{k}: missing (expected {want[k]})" for k in want if k not in got]
    lines += [f"{k}: unexpected {got[k]}" for k in got if k not in want]
    return lines


def fit_problems(adapter: ExpertLora | DeltaNetLora, dims: LayerDims | DeltaNetDims, lead: tuple[int, ...]) -> list[str]:
    """One line per leaf of `adapter` that does not have the shape `lead + target_shapes(dims, ...)`
    (`deltanet_target_shapes` for a `DeltaNetLora`; ranks read off its own factors, one per group);
    empty when it fits."""
    shapes = deltanet_target_shapes if isinstance(adapter, DeltaNetLora) else target_shapes
    scaled_rank = adapter._rank(adapter._scaled)
    want = {}
    for target in adapter.pairs():
        a, b = shapes(dims, target, scaled_rank if target in adapter._scaled else adapter.ffn_rank)
        want[f"{target}.a"], want[f"{target}.b"] = lead + a, lead + b
    return _mismatches(_leaf_shapes(adapter), want)


def shape_differences(adapter: ExpertLora, reference: ExpertLora) -> list[str]:
    """One line per leaf whose shape (or presence) differs between `adapter` and `reference`."""
    return _mismatches(_leaf_shapes(adapter), _leaf_shapes(reference))


def check_bank_fits(bank: LoraBank, layers) -> None:
    """Raises ValueError listing the bank leaves whose shapes do not fit `layers` (stacked or not)."""
    dims = layer_dims(layers)
    lines = fit_problems(bank.adapters, dims, (dims.depth, bank.num_adapters))
    if lines:
        raise ValueError("LoRA bank does not fit the expert's layers:\n" + "\n".join(f"  {line}" for line in lines))


# ---------------------------------------------------------------------------------------------
# Merging into the base weights
# ---------------------------------------------------------------------------------------------


def _weight_delta(target: str, pair: LoraPair, scaling: float) -> jax.Array:
    """ΔW in float32 (leading axes, e.g. L, broadcast through "...")."""
    hi = jax.lax.Precision.HIGHEST  # GPUs/TPUs would otherwise multiply float32 in reduced precision
    a, b = jnp.asarray(pair.a, jnp.float32), jnp.asarray(pair.b, jnp.float32)
    if target == "q":
        return scaling * jnp.einsum("...NDr,...NrH->...NDH", a, b, precision=hi)
    if target == "kv":
        return scaling * jnp.einsum("...2KDr,...2KrH->...2KDH", a, b, precision=hi)
    if target == "out":  # heads are summed in both factors
        return scaling * jnp.einsum("...NHr,...rD->...NHD", a, jnp.sum(b, axis=-3), precision=hi)
    if target == "gating":  # feed-forward LoRA: unscaled
        return jnp.einsum("...2Dr,...2rF->...2DF", a, b, precision=hi)
    return jnp.einsum("...Fr,...rD->...FD", a, b, precision=hi)


_DELTANET_MERGE_EQNS = {"qkv": "...Dr,...rC->...DC", "z": "...Dr,...rAZ->...DAZ", "out": "...AZr,...rD->...AZD"}


def _adapter_delta(adapter: ExpertLora | DeltaNetLora, target: str, pair: LoraPair) -> jax.Array:
    """ΔW of one target of `adapter` in float32 (a DeltaNet mixer target, or `_weight_delta`'s)."""
    if isinstance(adapter, DeltaNetLora) and target in DELTANET_MIXER_TARGETS:
        a, b = jnp.asarray(pair.a, jnp.float32), jnp.asarray(pair.b, jnp.float32)
        return adapter.scaling * jnp.einsum(_DELTANET_MERGE_EQNS[target], a, b, precision=jax.lax.Precision.HIGHEST)
    return _weight_delta(target, pair, adapter.scaling)


def merge_weight(w: jax.Array, target: str, pair: LoraPair, scaling: float) -> jax.Array:
    """`w + ΔW` computed in float32, returned in w's dtype (shapes: module docstring, same leading axes)."""
    return _plus(w, _weight_delta(target, pair, scaling))


def _plus(w: jax.Array, delta: jax.Array) -> jax.Array:
    """w + delta in float32, in w's dtype."""
    return (jnp.asarray(w, jnp.float32) + delta).astype(jnp.asarray(w).dtype)


def _merge_stacked(layers, adapter: ExpertLora | DeltaNetLora):
    changes = {t: _plus(getattr(layers, t), _adapter_delta(adapter, t, p)) for t, p in adapter.pairs().items()}
    return dataclasses.replace(layers, **changes)


@jax.jit  # one program per layer structure, not one dispatch per einsum and slice
def merge_layers(layers, adapter: ExpertLora | DeltaNetLora):
    """One expert's layer weights (stacked or `Unstacked`) with `adapter` ([L, ...] leaves) folded in.

    Any leading axes work for stacked weights (Qwen3.5's [G, P, ...]: `qwen35.merge_adapter`); a
    `DeltaNetLora` merges into Gated DeltaNet layers."""
    if isinstance(layers, Unstacked):
        return Unstacked(
            layers=tuple(
                _merge_stacked(lp, jax.tree.map(lambda x, i=i: x[i], adapter)) for i, lp in enumerate(layers.layers)
            )
        )
    return _merge_stacked(layers, adapter)

# ---------------------------------------------------------------------------------------------
# Per-row application inside a layer (used by backbone.forward_write)
# ---------------------------------------------------------------------------------------------

# (eqn x·A, eqn ·B, shape of the row selector given the number of rows) per target; `x` is the
# projection's input as `backbone` holds it.
_ROW_EQNS = {
    "q": ("BTD,NDr->BTNr", "BTNr,NrH->BTNH", lambda r: (r, 1, 1, 1)),
    "kv": ("BSD,2KDr->2BSKr", "2BSKr,2KrH->2BSKH", lambda r: (1, r, 1, 1, 1)),
    "out": ("BTNH,NHr->BTr", "BTr,NrD->BTD", lambda r: (r, 1, 1)),
    "gating": ("YD,2Dr->2Yr", "2Yr,2rF->2YF", lambda r: (1, r, 1)),
    "linear": ("YF,Fr->Yr", "Yr,rD->YD", lambda r: (r, 1)),
}


_DELTANET_ROW_EQNS = {
    "qkv": ("BTD,Dr->BTr", "BTr,rC->BTC", lambda r: (r, 1, 1)),
    "z": ("BTD,Dr->BTr", "BTr,rAZ->BTAZ", lambda r: (r, 1, 1, 1)),
    "out": ("BTAZ,AZr->BTr", "BTr,rD->BTD", lambda r: (r, 1, 1)),
    "gating": _ROW_EQNS["gating"],
    "linear": _ROW_EQNS["linear"],
}


@dataclasses.dataclass(frozen=True)
class LayerRows:
    """One layer's slice of a bank (leaves [E, ...]) and the row ids [B]; adds per-row LoRA terms.

    For each stored adapter n (a static loop; banks are small), the low-rank term is computed for
    ALL rows and kept only where `ids == n`: `y = where(ids == n, y + s·(x·A_n)·B_n, y)`. Rows on
    id 0 therefore keep the base projection bit for bit, and no per-row copy of A or B is
    gathered (the BGMV-style "masked dense" form).
    """

    adapters: ExpertLora
    ids: jax.Array

    def add(self, target: str, y: jax.Array, x: jax.Array) -> jax.Array:
        """`y` (the base projection of `x`) plus each row's adapter term for `target`.

        x / y layouts: q [B,T,D] -> [B,T,N,H]; kv [B,S,D] -> [2,B,S,K,H]; out [B,T,N,H] -> [B,T,D];
        gating [Y,D] -> [2,Y,F]; linear [Y,F] -> [Y,D], with Y = B*T rows in batch-major order.
        A `DeltaNetLora` slice: qkv [B,T,D] -> [B,T,C]; z [B,T,D] -> [B,T,A,Z]; out [B,T,A,Z] -> [B,T,D].
        """
        pair = getattr(self.adapters, target)
        if pair is None:
            return y
        eqn_a, eqn_b, sel_shape = (_DELTANET_ROW_EQNS if isinstance(self.adapters, DeltaNetLora) else _ROW_EQNS)[target]
        scaled = target in self.adapters._scaled
        ids = self.ids
        if target in FFN_TARGETS:  # feed-forward rows are the flattened (row, token) pairs
            ids = jnp.repeat(ids, x.shape[0] // ids.shape[0])
        for n in range(pair.a.shape[0]):
            delta = jnp.einsum(eqn_b, jnp.einsum(eqn_a, x, pair.a[n].astype(x.dtype)), pair.b[n].astype(x.dtype))
            if scaled:
                delta = delta * self.adapters.scaling
            sel = (ids == n + 1).reshape(sel_shape(ids.shape[0]))
            y = jnp.where(sel, y + delta.astype(y.dtype), y)
        return y
