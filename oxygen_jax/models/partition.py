"""Tensor parallelism of a model's weights: which axis of each weight is split over a `model` mesh axis.

Axes (`oxygen_jax.axes`): N query heads, K KV heads, D width, H head dim, F MLP width, V vocabulary; a
leading layer axis (stacked layers) may precede any of them, so every rule counts axes from the end.

One rule table, read by the leaf's dotted path (field names, dict keys, list indices), first match wins:

    leaf (path ends with)                 shape              split axis
    q, q_gate, kv, out                    [N, D, H], [2, K, D, H], [N, H, D]   N or K (heads)
    gating                                [2, D, F]          F (MLP columns: gate and up)
    linear                                [F, D]             F (MLP rows: down)
    embedding, lm_head                    [V, D]             V (vocabulary)
    query / key / value .kernel, .bias    [D, N, H], [N, H]  N (SigLIP heads)
    out.kernel                            [N, H, D]          N
    mlp_in .kernel, .bias / mlp_out.kernel  [D, F], [F] / [F, D]  F

Anything else (norms, biases of the output projections, Gated DeltaNet's mixer, action-head projections)
is replicated, and so is a matched leaf whose split axis does not divide by the axis size (Gemma-2B's single
KV head stays whole). A quantized weight (`nn.quant.QArray`) follows its weight's rule: `values` split like the
float weight, and `scale` (1 on the reduced input axes) split on the same axis where it keeps it (an output
channel: q, kv, gating, mlp_in) and replicated where that axis is reduced (out, linear, mlp_out: each device's
partial sums use the whole per-channel scale). Every sharding is exact: XLA's SPMD partitioner inserts the collectives (an all-reduce
after each attention output and MLP down projection), so a split only changes where the work runs and the
order of float32 sums, never what is computed.

    >>> param_specs({"q": jnp.zeros((8, 64, 16)), "norm": jnp.zeros((64,))}, "model", 2)
    {'norm': PartitionSpec(), 'q': PartitionSpec('model', None, None)}
"""

from __future__ import annotations

import dataclasses
import re

import jax
from jax.sharding import PartitionSpec

from oxygen_jax.nn.quant import QArray

TP_RULES: tuple[tuple[str, int], ...] = (
    (r"(^|\.)(q|q_gate|kv|out)$", -3),
    (r"(^|\.)gating$", -1),
    (r"(^|\.)linear$", -2),
    (r"(^|\.)(embedding|lm_head)$", -2),
    (r"(^|\.)(query|key|value)\.(kernel|bias)$", -2),
    (r"(^|\.)out\.kernel$", -3),
    (r"(^|\.)mlp_in\.(kernel|bias)$", -1),
    (r"(^|\.)mlp_out\.kernel$", -2),
)
"""(regular expression over the leaf's dotted path, e.g. `params.decoder.layers.q`, split axis counted from the
end); first match wins."""


def _leaf_spec(path: str, shape: tuple[int, ...], axis_name: str, size: int) -> PartitionSpec:
    for pattern, axis in TP_RULES:
        if re.search(pattern, path):
            if len(shape) < -axis or shape[axis] % size:
                return PartitionSpec()
            spec = [None] * len(shape)
            spec[axis] = axis_name
            return PartitionSpec(*spec)
    return PartitionSpec()


def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):  # GetAttrKey, DictKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_specs(tree, axis_name: str, size: int):
    """A tree like `tree` (any weights pytree: a `MultiHead`, a decoder, a params tree) of `PartitionSpec`s that
    split each weight by `TP_RULES` over mesh axis `axis_name` of `size` devices (size 1: all replicated)."""
    if size < 1:
        raise ValueError(f"the tensor-parallel axis size must be >= 1, got {size}")

    def spec(path, leaf):
        if isinstance(leaf, QArray):  # each of its arrays by the weight's rule (module docstring)
            return dataclasses.replace(leaf, values=spec(path, leaf.values), scale=spec(path, leaf.scale))
        if size == 1 or not hasattr(leaf, "shape"):
            return PartitionSpec()
        return _leaf_spec(".".join(map(_key_name, path)), tuple(leaf.shape), axis_name, size)

    return jax.tree_util.tree_map_with_path(spec, tree, is_leaf=lambda x: isinstance(x, QArray))

