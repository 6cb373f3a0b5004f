"""openpi's checkpoint layout of π0.5's LoRA factors: their paths, shape checks, and conversion to and from
`pi05.lora.ModelLora`.

Axes (`oxygen_jax.axes`): L layers, r LoRA rank. An openpi LoRA checkpoint stores, beside each base
weight it adapts, two factors with a leading L axis (shapes: `models/lora.py`):

    attention      PaliGemma/llm/layers/attn/{q_einsum,kv_einsum,attn_vec_einsum}{sfx}/lora_{a,b}
    feed-forward   PaliGemma/llm/layers/mlp{sfx}/{gating_einsum,linear}_lora_{a,b}

with sfx "" for the VLM expert and "_1" for the action expert (`pi05.lora.EXPERTS`). alpha is not
stored: `from_openpi` takes it (default alpha = rank, openpi's shipped variants).
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp

from oxygen_jax.models.lora import ATTN_TARGETS, FFN_TARGETS, TARGETS, ExpertLora, LoraPair, merge_weight, target_shapes
from oxygen_jax.models.pi05.config import ModelConfig
from oxygen_jax.models.pi05.lora import EXPERTS, ModelLora, expert_dims

_LLM = "PaliGemma/llm/layers"


def openpi_paths(target: str, suffix: str) -> tuple[str, str]:
    """openpi's (lora_a, lora_b) paths of `target` for the expert with path suffix "" or "_1"."""
    if target in FFN_TARGETS:
        base = f"{_LLM}/mlp{suffix}/{'gating_einsum' if target == 'gating' else 'linear'}"
        return f"{base}_lora_a", f"{base}_lora_b"
    name = {"q": "q_einsum", "kv": "kv_einsum", "out": "attn_vec_einsum"}[target]
    base = f"{_LLM}/attn/{name}{suffix}"
    return f"{base}/lora_a", f"{base}/lora_b"


def openpi_weight_path(target: str, suffix: str) -> str:
    """openpi path of the base weight a target updates."""
    if target in FFN_TARGETS:
        return f"{_LLM}/mlp{suffix}/{'gating_einsum' if target == 'gating' else 'linear'}"
    name = {"q": "q_einsum", "kv": "kv_einsum", "out": "attn_vec_einsum"}[target]
    return f"{_LLM}/attn/{name}{suffix}/w"


def is_lora_path(path: str) -> bool:
    """Whether an openpi parameter path is a LoRA factor (`.../lora_a`, `..._lora_b`)."""
    last = path.rsplit("/", 1)[-1]
    return last in ("lora_a", "lora_b") or last.endswith(("_lora_a", "_lora_b"))


_KNOWN_PATHS = {
    p: (field, target, which)
    for field, sfx in EXPERTS
    for target in TARGETS
    for which, p in zip("ab", openpi_paths(target, sfx))
}


def _infer_ranks(shapes: Mapping[str, tuple[int, ...]], suffix: str) -> dict[str, int | None]:
    """{"attn": rank, "ffn": rank} read off the lora_a leaves present (last axis), None if absent."""
    out = {}
    for group, targets in (("attn", ATTN_TARGETS), ("ffn", FFN_TARGETS)):
        a_paths = [openpi_paths(t, suffix)[0] for t in targets]
        out[group] = next((int(shapes[p][-1]) for p in a_paths if p in shapes and len(shapes[p])), None)
    return out


def expected_openpi_shapes(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
    """The shape each LoRA path present in `shapes` must have for `config`.

    Ranks are inferred per expert and per group (attention / feed-forward) from the `lora_a`
    leaves present, so nothing depends on a particular rank. A LoRA path openpi never writes
    maps to None.
    """
    expected: dict[str, tuple[int, ...] | None] = {}
    ranks = {sfx: _infer_ranks(shapes, sfx) for _, sfx in EXPERTS}
    for path in shapes:
        if not is_lora_path(path):
            continue
        if path not in _KNOWN_PATHS:
            expected[path] = None
            continue
        field, target, which = _KNOWN_PATHS[path]
        sfx = dict(EXPERTS)[field]
        rank = ranks[sfx]["attn" if target in ATTN_TARGETS else "ffn"]
        ecfg = getattr(config, field)
        a_shape, b_shape = target_shapes(expert_dims(ecfg), target, rank)
        expected[path] = (ecfg.depth,) + (a_shape if which == "a" else b_shape)
    return expected


def check_openpi_shapes(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig) -> list[str]:
    """One line per problem with the LoRA leaves of `shapes` (empty = all fine): unknown paths,
    a factor without its partner, mis-shaped factors (with both shapes)."""
    problems = []
    expected = expected_openpi_shapes(shapes, config)
    for path, exp in sorted(expected.items()):
        got = tuple(int(d) for d in shapes[path])
        if exp is None:
            problems.append(f"{path}: not a LoRA leaf openpi writes")
        elif got != exp:
            problems.append(f"{path}: expected {exp}, got {got}")
    for path in sorted(expected):
        if path in _KNOWN_PATHS:
            field, target, which = _KNOWN_PATHS[path]
            partner = openpi_paths(target, dict(EXPERTS)[field])[1 if which == "a" else 0]
            if partner not in shapes:
                problems.append(f"{partner}: missing (its partner {path} is present)")
    return problems


def _expert_alpha(alpha, field: str, rank: int | None) -> float:
    if isinstance(alpha, Mapping):
        alpha = alpha.get(field)
    if alpha is None:
        return float(rank) if rank is not None else 1.0
    return float(alpha)


def from_openpi(
    flat: Mapping[str, jax.Array],
    config: ModelConfig,
    *,
    alpha: float | Mapping[str, float | None] | None = None,
    rslora: bool = False,
) -> ModelLora | None:
    """Collects the LoRA leaves of a flat {openpi path: array} dict into a `ModelLora`.

    Args:
      flat: openpi paths as in `pi05_lora_param_manifest.json`; non-LoRA keys are ignored.
      config: the model the adapters belong to (shapes are checked against it).
      alpha: the training alpha: one number for both experts, or {"vlm": a0, "action_expert": a1};
        None (or a missing entry) means alpha = rank, openpi's shipped variants.
      rslora: whether the adapters were trained with rank-stabilised scaling.

    Returns:
      The adapters (an expert without LoRA leaves gets None), or None when `flat` has no LoRA leaf.

    Raises:
      ValueError: listing every unknown, unpaired or mis-shaped LoRA leaf.
    """
    shapes = {k: tuple(v.shape) for k, v in flat.items()}
    if not any(is_lora_path(k) for k in shapes):
        return None
    problems = check_openpi_shapes(shapes, config)
    if problems:
        raise ValueError("LoRA leaves do not fit the model:\n" + "\n".join(f"  {p}" for p in problems))
    experts = {}
    for field, sfx in EXPERTS:
        pairs = {}
        for target in TARGETS:
            pa, pb = openpi_paths(target, sfx)
            pairs[target] = LoraPair(a=flat[pa], b=flat[pb]) if pa in flat else None
        if all(p is None for p in pairs.values()):
            experts[field] = None
            continue
        attn_rank = _infer_ranks(shapes, sfx)["attn"]
        experts[field] = ExpertLora(**pairs, alpha=_expert_alpha(alpha, field, attn_rank), rslora=rslora)
    return ModelLora(**experts)


def to_openpi(adapters: ModelLora) -> dict[str, jax.Array]:
    """Flat {openpi path: array} of the adapters (inverse of `from_openpi`; alpha is not stored)."""
    out = {}
    for field, sfx in EXPERTS:
        expert = getattr(adapters, field)
        if expert is None:
            continue
        for target, pair in expert.pairs().items():
            pa, pb = openpi_paths(target, sfx)
            out[pa], out[pb] = pair.a, pair.b
    return out


def merge_openpi(flat: Mapping[str, jax.Array], adapters: ModelLora, dtype=None) -> dict[str, jax.Array]:
    """`merge` on a flat {openpi path: array} dict: the updated base weights replace their entries,
    in `dtype` (default: each weight's own)."""
    weights = {
        field: {t: flat[openpi_weight_path(t, sfx)] for t in getattr(adapters, field).pairs()}
        for field, sfx in EXPERTS
        if getattr(adapters, field) is not None
    }
    merged = _merge_targets(weights, adapters, None if dtype is None else jnp.dtype(dtype))
    out = dict(flat)
    for field, sfx in EXPERTS:
        for target, w in merged.get(field, {}).items():
            out[openpi_weight_path(target, sfx)] = w
    return out


@functools.partial(jax.jit, static_argnames=("dtype",))  # all targets of both experts in one program
def _merge_targets(weights: dict, adapters: ModelLora, dtype) -> dict:
    def one(field, target, w):
        adapter = getattr(adapters, field)
        merged = merge_weight(w, target, getattr(adapter, target), adapter.scaling)
        return merged if dtype is None else merged.astype(dtype)

    return {field: {t: one(field, t, w) for t, w in ws.items()} for field, ws in weights.items()}
