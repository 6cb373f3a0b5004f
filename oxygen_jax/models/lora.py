"""openpi LoRA adapters as pytrees: checkpoint layout, merging, and banks served per row.

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
  `init_bank` (for adapters trained here) uses B = 0 instead.

alpha is not stored in checkpoints. openpi's shipped variants (`gemma_2b_lora`: rank 16,
`gemma_300m_lora`: rank 32) use alpha = rank, i.e. s = 1; pass the alpha a checkpoint was trained
with when it differs. Only the attention LoRA depends on it.

Pytrees (leaves are arrays; alpha and rslora are static):

* `ExpertLora` — one adapter of one expert, leaves as openpi stores them (leading L axis), or
  without the L axis for one layer. Targets without LoRA are None.
* `ModelLora` — the adapters of both experts as restored from a checkpoint (either may be None).
* `LoraBank` — E adapters of one expert, every leaf stacked on axis 1: [L, E, ...]. The layer
  loop slices axis 0 (scan or unrolled), leaving [E, ...] per layer. Adapter id n in 1..E is bank
  index n - 1; id 0 means the base weights and is not stored, so a bank of E adapters serves the
  ids 0..E. Ids outside 0..E get the base weights.
* `RowAdapters(bank, ids)` — the `lora` argument of `backbone.forward_write`: one adapter id per row.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models.pi05.config import ExpertConfig, ModelConfig
from oxygen_jax.nn.layers import Unstacked
from oxygen_jax.models.pi05.params import Expert, ExpertLayers, Params

TARGETS = ("q", "kv", "out", "gating", "linear")
"""LoRA targets, named after the `ExpertLayers` weights they update."""
_ATTN = ("q", "kv", "out")
_FFN = ("gating", "linear")
EXPERTS = (("vlm", ""), ("action_expert", "_1"))
"""(ModelLora / Params field, openpi path suffix) of the two experts."""
_LLM = "PaliGemma/llm/layers"


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


_STATIC = dict(static=True)


@_pytree
class LoraPair:
    """The two factors of one target: `a` [..., in, r], `b` [..., r, out] (openpi's lora_a / lora_b)."""

    a: jax.Array
    b: jax.Array


@_pytree
class ExpertLora:
    """One LoRA adapter of one Gemma expert (shapes in the module docstring, plus a leading L).

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

    def pairs(self) -> dict[str, LoraPair]:
        """{target: pair} for the targets that have LoRA."""
        return {t: getattr(self, t) for t in TARGETS if getattr(self, t) is not None}

    @property
    def attn_rank(self) -> int | None:
        pair = next((getattr(self, t) for t in _ATTN if getattr(self, t) is not None), None)
        return None if pair is None else int(pair.a.shape[-1])

    @property
    def ffn_rank(self) -> int | None:
        pair = next((getattr(self, t) for t in _FFN if getattr(self, t) is not None), None)
        return None if pair is None else int(pair.a.shape[-1])

    @property
    def scaling(self) -> float:
        """openpi's `scaling_value` of the attention LoRA (1.0 when there is none)."""
        r = self.attn_rank
        if r is None:
            return 1.0
        return self.alpha / math.sqrt(r) if self.rslora else self.alpha / r

    def replace(self, **changes) -> "ExpertLora":
        return dataclasses.replace(self, **changes)


@_pytree
class ModelLora:
    """Adapters of both experts, as an openpi LoRA checkpoint holds them (None: no LoRA there)."""

    vlm: ExpertLora | None
    action_expert: ExpertLora | None


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
# Shapes and the openpi layout
# ---------------------------------------------------------------------------------------------


def target_shapes(expert: ExpertConfig, target: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A shape, B shape) of one target for one layer (no L axis)."""
    d, f, n, k, h = expert.width, expert.mlp_dim, expert.num_heads, expert.num_kv_heads, expert.head_dim
    return {
        "q": ((n, d, rank), (n, rank, h)),
        "kv": ((2, k, d, rank), (2, k, rank, h)),
        "out": ((n, h, rank), (n, rank, d)),
        "gating": ((2, d, rank), (2, rank, f)),
        "linear": ((f, rank), (rank, d)),
    }[target]


def openpi_paths(target: str, suffix: str) -> tuple[str, str]:
    """openpi's (lora_a, lora_b) paths of `target` for the expert with path suffix "" or "_1"."""
    if target in _FFN:
        base = f"{_LLM}/mlp{suffix}/{'gating_einsum' if target == 'gating' else 'linear'}"
        return f"{base}_lora_a", f"{base}_lora_b"
    name = {"q": "q_einsum", "kv": "kv_einsum", "out": "attn_vec_einsum"}[target]
    base = f"{_LLM}/attn/{name}{suffix}"
    return f"{base}/lora_a", f"{base}/lora_b"


def openpi_weight_path(target: str, suffix: str) -> str:
    """openpi path of the base weight a target updates."""
    if target in _FFN:
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
    for group, targets in (("attn", _ATTN), ("ffn", _FFN)):
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
        rank = ranks[sfx]["attn" if target in _ATTN else "ffn"]
        ecfg = getattr(config, field)
        a_shape, b_shape = target_shapes(ecfg, target, rank)
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


def merge_weight(w: jax.Array, target: str, pair: LoraPair, scaling: float) -> jax.Array:
    """`w + ΔW` computed in float32, returned in w's dtype (shapes: module docstring, same leading axes)."""
    merged = jnp.asarray(w, jnp.float32) + _weight_delta(target, pair, scaling)
    return merged.astype(jnp.asarray(w).dtype)


def _merge_stacked(layers: ExpertLayers, adapter: ExpertLora) -> ExpertLayers:
    changes = {t: merge_weight(getattr(layers, t), t, p, adapter.scaling) for t, p in adapter.pairs().items()}
    return dataclasses.replace(layers, **changes)


@jax.jit  # one program per layer structure, not one dispatch per einsum and slice
def merge_layers(layers: ExpertLayers | Unstacked, adapter: ExpertLora) -> ExpertLayers | Unstacked:
    """One expert's layer weights with `adapter` ([L, ...] leaves) folded in; stacked and `Unstacked` layers alike."""
    if isinstance(layers, Unstacked):
        return Unstacked(
            layers=tuple(
                _merge_stacked(lp, jax.tree.map(lambda x, i=i: x[i], adapter)) for i, lp in enumerate(layers.layers)
            )
        )
    return _merge_stacked(layers, adapter)


def merge(params: Params, adapters: ModelLora) -> Params:
    """Base parameters with every adapter folded in: W + s·ΔW exactly as openpi's LoRA computes it
    (head-summed attn_vec, unscaled feed-forward), in float32, cast back to each weight's dtype.

    The result runs the whole-sequence LoRA openpi trains through the ordinary (LoRA-free)
    functions. Works on stacked and `Unstacked` (`params.for_backend` on CPU) parameters.
    """

    def expert(e: Expert, adapter: ExpertLora | None) -> Expert:
        return e if adapter is None else dataclasses.replace(e, layers=merge_layers(e.layers, adapter))

    return params.replace(
        vlm=expert(params.vlm, adapters.vlm), action_expert=expert(params.action_expert, adapters.action_expert)
    )


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


# ---------------------------------------------------------------------------------------------
# Banks
# ---------------------------------------------------------------------------------------------


def _expert_config(config: ExpertConfig | ModelConfig) -> ExpertConfig:
    return config.vlm if isinstance(config, ModelConfig) else config


def _expected_expert_shapes(adapter: ExpertLora, expert: ExpertConfig, lead: tuple[int, ...]) -> dict[str, tuple]:
    ranks = {"attn": adapter.attn_rank, "ffn": adapter.ffn_rank}
    out = {}
    for target in adapter.pairs():
        a, b = target_shapes(expert, target, ranks["attn" if target in _ATTN else "ffn"])
        out[f"{target}.a"], out[f"{target}.b"] = lead + a, lead + b
    return out


def _leaf_shapes(adapter: ExpertLora) -> dict[str, tuple]:
    out = {}
    for target, pair in adapter.pairs().items():
        out[f"{target}.a"], out[f"{target}.b"] = tuple(pair.a.shape), tuple(pair.b.shape)
    return out


def _mismatches(got: dict[str, tuple], want: dict[str, tuple]) -> list[str]:
    lines = [f"{k}: expected {want[k]}, got {got[k]}" for k in want if k in got and got[k] != want[k]]
    lines += [f"{k}: missing (expected {want[k]})" for k in want if k not in got]
    lines += [f"{k}: unexpected {got[k]}" for k in got if k not in want]
    return lines


def check_adapter(adapter: ExpertLora, config: ExpertConfig | ModelConfig) -> None:
    """Raises ValueError listing every leaf of `adapter` ([L, ...] leaves) that does not fit the
    expert (the VLM expert for a `ModelConfig`), or whose rank differs within its group."""
    expert = _expert_config(config)
    lines = _mismatches(_leaf_shapes(adapter), _expected_expert_shapes(adapter, expert, (expert.depth,)))
    if lines:
        raise ValueError("LoRA adapter does not fit the expert:\n" + "\n".join(f"  {line}" for line in lines))


def stack_adapters(adapters: Sequence[ExpertLora], config: ExpertConfig | ModelConfig | None = None) -> LoraBank:
    """Stacks single adapters (leaves [L, ...]) into a bank; adapter i of the list gets id i + 1.

    All adapters must have the same targets, ranks, shapes, alpha and rslora (the bank's rank and
    scaling are static); `config`, when given, is checked too (a `ModelConfig` means its VLM expert).

    Raises:
      ValueError: naming the adapter and listing every mismatched leaf.
    """
    if not adapters:
        raise ValueError("stack_adapters needs at least one adapter (id 0, the base weights, is implicit)")
    first = adapters[0]
    if config is not None:
        check_adapter(first, config)
    ref = _leaf_shapes(first)
    for i, ad in enumerate(adapters[1:], start=1):
        lines = _mismatches(_leaf_shapes(ad), ref)
        if (ad.alpha, ad.rslora) != (first.alpha, first.rslora):
            lines.append(f"alpha/rslora: expected {(first.alpha, first.rslora)}, got {(ad.alpha, ad.rslora)}")
        if lines:
            raise ValueError(
                f"adapter {i} (id {i + 1}) does not match adapter 0 (id 1); a bank needs one rank and shape:\n"
                + "\n".join(f"  {line}" for line in lines)
            )
    return LoraBank(adapters=_stack(*adapters))


@jax.jit
def _stack(*adapters: ExpertLora) -> ExpertLora:
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *adapters)


def init_bank(
    config: ExpertConfig | ModelConfig,
    num_adapters: int,
    rank: int,
    alpha: float | None = None,
    seed: int = 0,
    *,
    rslora: bool = False,
    targets: Sequence[str] = TARGETS,
    dtype=None,
) -> LoraBank:
    """A bank of `num_adapters` fresh adapters for training: A ~ N(0, 1/fan_in), B = 0.

    With B = 0 every adapter is exactly the base model until trained (unlike openpi's
    normal(0.01) init of both factors).

    Args:
      config: the expert (a `ModelConfig` means its VLM expert, the one that serves language).
      num_adapters: E; the bank serves ids 0 (base) .. E.
      rank: r, for every target.
      alpha: attention scaling numerator; default rank (scaling 1, as openpi's variants).
      seed: numpy seed (adapter i, target t drawn from PCG64([seed, i, t])).
      targets: subset of `TARGETS` that get LoRA.
      dtype: leaf dtype; default the `ModelConfig`'s dtype, else float32.

    Returns:
      A `LoraBank` with leaves [L, E, ...].
    """
    expert = _expert_config(config)
    if dtype is None:
        dtype = config.jnp_dtype if isinstance(config, ModelConfig) else jnp.float32
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or num_adapters < 1 or rank < 1:
        raise ValueError(
            f"init_bank: need num_adapters >= 1, rank >= 1 and targets from {TARGETS}; "
            f"got {num_adapters}, {rank}, {unknown or targets}"
        )
    pairs = {}
    for ti, target in enumerate(TARGETS):
        if target not in targets:
            pairs[target] = None
            continue
        a_shape, b_shape = target_shapes(expert, target, rank)
        fan_in = expert.num_heads * expert.head_dim if target == "out" else a_shape[-2]  # contracted size
        draws = [
            np.random.default_rng([seed, i, ti]).standard_normal((expert.depth,) + a_shape, dtype=np.float32)
            for i in range(num_adapters)
        ]
        a = np.stack(draws, axis=1) / np.float32(math.sqrt(fan_in))
        b = np.zeros((expert.depth, num_adapters) + b_shape, np.float32)
        # Cast on the host and transfer: no per-shape device programs.
        pairs[target] = LoraPair(a=jax.device_put(a.astype(dtype)), b=jax.device_put(b.astype(dtype)))
    return LoraBank(adapters=ExpertLora(**pairs, alpha=float(rank if alpha is None else alpha), rslora=rslora))


def check_bank_fits(bank: LoraBank, layers: ExpertLayers | Unstacked) -> None:
    """Raises ValueError listing the bank leaves whose shapes do not fit `layers` (stacked or not)."""
    if isinstance(layers, Unstacked):
        depth, first = len(layers.layers), layers.layers[0]
        n, d, h = first.q.shape
        k, f = first.kv.shape[1], first.gating.shape[-1]
    else:
        depth, n, d, h = layers.q.shape
        k, f = layers.kv.shape[2], layers.gating.shape[-1]
    expert = ExpertConfig(width=d, depth=depth, mlp_dim=f, num_heads=n, num_kv_heads=k, head_dim=h)
    want = _expected_expert_shapes(bank.adapters, expert, (depth, bank.num_adapters))
    lines = _mismatches(_leaf_shapes(bank.adapters), want)
    if lines:
        raise ValueError("LoRA bank does not fit the expert's layers:\n" + "\n".join(f"  {line}" for line in lines))


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


@dataclasses.dataclass(frozen=True)
class LayerRows:
    """One layer's slice of a bank (leaves [E, ...]) and the row ids [B]; adds per-row LoRA terms.

    For each stored adapter n (a static loop; banks are small), the low-rank term is computed for
    ALL rows and kept only where `ids == n`: `y = where(ids == n, y + s·(x·A_n)·B_n, y)`. Rows on
    id 0 therefore keep the base projection bit for bit, and no per-row copy of A or B is
    gathered (the BGMV-style "masked dense" form; see docs/memory_lora.md §4).
    """

    adapters: ExpertLora
    ids: jax.Array

    def add(self, target: str, y: jax.Array, x: jax.Array) -> jax.Array:
        """`y` (the base projection of `x`) plus each row's adapter term for `target`.

        x / y layouts: q [B,T,D] -> [B,T,N,H]; kv [B,S,D] -> [2,B,S,K,H]; out [B,T,N,H] -> [B,T,D];
        gating [Y,D] -> [2,Y,F]; linear [Y,F] -> [Y,D], with Y = B*T rows in batch-major order.
        """
        pair = getattr(self.adapters, target)
        if pair is None:
            return y
        eqn_a, eqn_b, sel_shape = _ROW_EQNS[target]
        ids = self.ids
        if target in _FFN:  # feed-forward rows are the flattened (row, token) pairs
            ids = jnp.repeat(ids, x.shape[0] // ids.shape[0])
        for n in range(pair.a.shape[0]):
            delta = jnp.einsum(eqn_b, jnp.einsum(eqn_a, x, pair.a[n].astype(x.dtype)), pair.b[n].astype(x.dtype))
            if target in _ATTN:
                delta = delta * self.adapters.scaling
            sel = (ids == n + 1).reshape(sel_shape(ids.shape[0]))
            y = jnp.where(sel, y + delta.astype(y.dtype), y)
        return y
