"""π0.5 parameters as registered-dataclass pytrees, described once by a table.

Axes (`oxygen_jax.axes`): L layers (stacked for `lax.scan`), D expert width, F MLP hidden, N query
heads, K KV heads, H head dim, V vocabulary, W SigLIP width, Fv SigLIP MLP, Nv SigLIP heads, Hv SigLIP
head dim, p patch size, Np patches per image, Ad model action dim, Dc adaRMS condition width (= action
expert width).

`_spec(config)` is the single description of every leaf of a variant: its openpi checkpoint path, its
attribute path in `Params`, its shape as a function of the config, and its initialiser. `init_params`,
`abstract_params`, `to_openpi_dict` and `from_openpi_dict` are all derived from it, so the
checkpoint mapping, the random init and the abstract shapes cannot disagree.

The two variants (`ModelConfig.variant`, openpi's `Pi0Config.pi05`) share every leaf but the action
expert's time input: π0.5 has adaRMS norms (`*_norm_1/Dense_0`) and `time_mlp_in/out` [Da, Da]; π0 has
plain norm scales, `action_time_mlp_in` [2 Da, Da] / `action_time_mlp_out` [Da, Da] (held in the same
`time_mlp_in` / `time_mlp_out` fields) and `state_proj` [Ad, Da] (51 and 50 leaves).

π0-FAST (`config.Pi0FastConfig`, variant "pi0_fast") is the PaliGemma part alone: the embedder, the VLM expert
and SigLIP (32 leaves, `Pi0FastParams`), the same rows of the table as π0.5's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models.pi05.config import ModelConfig, Pi0FastConfig
from oxygen_jax.models.vision.siglip import Siglip, SiglipLayers
from oxygen_jax.nn import layers as nn_layers
from oxygen_jax.nn.layers import AdaRMSNorm, Dense, LayerNorm, RMSNorm, _pytree


@_pytree
class ExpertLayers:
    """One Gemma expert's per-layer weights, stacked on a leading L axis."""

    q: jax.Array  # [L, N, D, H]
    kv: jax.Array  # [L, 2, K, D, H]; index 0 = K, 1 = V
    out: jax.Array  # [L, N, H, D]
    attn_norm: RMSNorm | AdaRMSNorm
    ffw_norm: RMSNorm | AdaRMSNorm
    gating: jax.Array  # [L, 2, D, F]; index 0 = gelu gate, 1 = up
    linear: jax.Array  # [L, F, D]


@_pytree
class Expert:
    layers: ExpertLayers
    final_norm: RMSNorm | AdaRMSNorm


@_pytree
class Params:
    embedding: jax.Array  # [V, D_vlm]; token embedder and tied LM head
    vlm: Expert  # expert 0: prefix and text (plain RMSNorm)
    action_expert: Expert  # expert 1: action suffix (adaRMSNorm)
    siglip: Siglip
    action_in: Dense  # [Ad, Da]
    time_mlp_in: Dense  # π0.5 [Da, Da]; π0 (action_time_mlp_in) [2 Da, Da]
    time_mlp_out: Dense  # [Da, Da]
    action_out: Dense  # [Da, Ad]
    config: ModelConfig = dataclasses.field(metadata=dict(static=True))  # static: part of the treedef
    state_proj: Dense | None = None  # π0 only: [Ad, Da], the state token

    def replace(self, **changes) -> "Params":
        return dataclasses.replace(self, **changes)

    def with_config(self, **changes) -> "Params":
        """Same arrays, config fields changed (e.g. `prompt_attention="causal"`); shapes must still fit."""
        return dataclasses.replace(self, config=self.config.replace(**changes))


@_pytree
class Pi0FastParams:
    """π0-FAST's one PaliGemma: the embedder (tied head), the VLM expert and SigLIP; no action expert."""

    embedding: jax.Array  # [V, D]
    vlm: Expert
    siglip: Siglip
    config: Pi0FastConfig = dataclasses.field(metadata=dict(static=True))

    def replace(self, **changes) -> "Pi0FastParams":
        return dataclasses.replace(self, **changes)


class _Leaf(NamedTuple):
    openpi: str  # "/"-joined path inside the openpi `params` tree
    attr: tuple[str, ...]  # attribute path inside `Params`
    shape: Callable[[ModelConfig], tuple[int, ...]]
    init: str  # "fan_in:<axes>" (normal / sqrt(prod of those axes)), "embed", "small", "gate_bias"


def _expert_leaves(prefix: str, attr: str, sfx: str, get, adaptive: bool) -> list[_Leaf]:
    llm = "PaliGemma/llm/layers"
    leaves = [
        _Leaf(f"{llm}/attn/q_einsum{sfx}/w", (attr, "layers", "q"), lambda c: (get(c).depth, get(c).num_heads, get(c).width, get(c).head_dim), "fan_in:2"),
        _Leaf(f"{llm}/attn/kv_einsum{sfx}/w", (attr, "layers", "kv"), lambda c: (get(c).depth, 2, get(c).num_kv_heads, get(c).width, get(c).head_dim), "fan_in:3"),
        _Leaf(f"{llm}/attn/attn_vec_einsum{sfx}/w", (attr, "layers", "out"), lambda c: (get(c).depth, get(c).num_heads, get(c).head_dim, get(c).width), "fan_in:1,2"),
        _Leaf(f"{llm}/mlp{sfx}/gating_einsum", (attr, "layers", "gating"), lambda c: (get(c).depth, 2, get(c).width, get(c).mlp_dim), "fan_in:2"),
        _Leaf(f"{llm}/mlp{sfx}/linear", (attr, "layers", "linear"), lambda c: (get(c).depth, get(c).mlp_dim, get(c).width), "fan_in:1"),
    ]
    for name, field in (("pre_attention_norm", "attn_norm"), ("pre_ffw_norm", "ffw_norm")):
        leaves += _norm_leaves(f"{llm}/{name}{sfx}", (attr, "layers", field), get, adaptive, stacked=True)
    leaves += _norm_leaves(f"PaliGemma/llm/final_norm{sfx}", (attr, "final_norm"), get, adaptive, stacked=False)
    return leaves


def _norm_leaves(path, attr, get, adaptive, stacked) -> list[_Leaf]:
    lead = (lambda c: (get(c).depth,)) if stacked else (lambda c: ())
    if not adaptive:
        return [_Leaf(f"{path}/scale", attr + ("scale",), lambda c: lead(c) + (get(c).width,), "small")]
    cond = lambda c: c.action_expert.width  # noqa: E731
    return [
        _Leaf(f"{path}/Dense_0/kernel", attr + ("modulation", "kernel"), lambda c: lead(c) + (cond(c), 3 * get(c).width), "fan_in:-2"),
        _Leaf(f"{path}/Dense_0/bias", attr + ("modulation", "bias"), lambda c: lead(c) + (3 * get(c).width,), "gate_bias"),
    ]


def _siglip_leaves() -> list[_Leaf]:
    img, blk = "PaliGemma/img", "PaliGemma/img/Transformer/encoderblock"
    s = lambda c: c.siglip  # noqa: E731
    leaves = [
        _Leaf(f"{img}/embedding/kernel", ("siglip", "patch", "kernel"), lambda c: (s(c).patch_size, s(c).patch_size, 3, s(c).width), "fan_in:0,1,2"),
        _Leaf(f"{img}/embedding/bias", ("siglip", "patch", "bias"), lambda c: (s(c).width,), "small"),
        _Leaf(f"{img}/pos_embedding", ("siglip", "pos_embedding"), lambda c: (1, s(c).num_patches, s(c).width), "pos"),
        _Leaf(f"{img}/Transformer/encoder_norm/scale", ("siglip", "norm", "scale"), lambda c: (s(c).width,), "one"),
        _Leaf(f"{img}/Transformer/encoder_norm/bias", ("siglip", "norm", "bias"), lambda c: (s(c).width,), "small"),
        _Leaf(f"{img}/head/kernel", ("siglip", "head", "kernel"), lambda c: (s(c).width, c.vlm.width), "fan_in:0"),
        _Leaf(f"{img}/head/bias", ("siglip", "head", "bias"), lambda c: (c.vlm.width,), "small"),
    ]
    for ln, field in (("LayerNorm_0", "ln0"), ("LayerNorm_1", "ln1")):
        leaves += [
            _Leaf(f"{blk}/{ln}/scale", ("siglip", "layers", field, "scale"), lambda c: (s(c).depth, s(c).width), "one"),
            _Leaf(f"{blk}/{ln}/bias", ("siglip", "layers", field, "bias"), lambda c: (s(c).depth, s(c).width), "small"),
        ]
    mha = f"{blk}/MultiHeadDotProductAttention_0"
    for name in ("query", "key", "value"):
        leaves += [
            _Leaf(f"{mha}/{name}/kernel", ("siglip", "layers", name, "kernel"), lambda c: (s(c).depth, s(c).width, s(c).num_heads, s(c).head_dim), "fan_in:1"),
            _Leaf(f"{mha}/{name}/bias", ("siglip", "layers", name, "bias"), lambda c: (s(c).depth, s(c).num_heads, s(c).head_dim), "small"),
        ]
    leaves += [
        _Leaf(f"{mha}/out/kernel", ("siglip", "layers", "out", "kernel"), lambda c: (s(c).depth, s(c).num_heads, s(c).head_dim, s(c).width), "fan_in:1,2"),
        _Leaf(f"{mha}/out/bias", ("siglip", "layers", "out", "bias"), lambda c: (s(c).depth, s(c).width), "small"),
        _Leaf(f"{blk}/MlpBlock_0/Dense_0/kernel", ("siglip", "layers", "mlp_in", "kernel"), lambda c: (s(c).depth, s(c).width, s(c).mlp_dim), "fan_in:1"),
        _Leaf(f"{blk}/MlpBlock_0/Dense_0/bias", ("siglip", "layers", "mlp_in", "bias"), lambda c: (s(c).depth, s(c).mlp_dim), "small"),
        _Leaf(f"{blk}/MlpBlock_0/Dense_1/kernel", ("siglip", "layers", "mlp_out", "kernel"), lambda c: (s(c).depth, s(c).mlp_dim, s(c).width), "fan_in:1"),
        _Leaf(f"{blk}/MlpBlock_0/Dense_1/bias", ("siglip", "layers", "mlp_out", "bias"), lambda c: (s(c).depth, s(c).width), "small"),
    ]
    return leaves


def _dense_leaves(name: str, attr: str, shape) -> list[_Leaf]:
    return [
        _Leaf(f"{name}/kernel", (attr, "kernel"), shape, "fan_in:0"),
        _Leaf(f"{name}/bias", (attr, "bias"), lambda c: shape(c)[-1:], "small"),
    ]


def _variant_leaves(pi05: bool) -> tuple[_Leaf, ...]:
    da = lambda c: c.action_expert.width  # noqa: E731
    if pi05:
        time = (_dense_leaves("time_mlp_in", "time_mlp_in", lambda c: (da(c), da(c)))
                + _dense_leaves("time_mlp_out", "time_mlp_out", lambda c: (da(c), da(c))))
    else:  # π0: [action tokens ‖ sincos(t)] mixed by an MLP, and the state as one suffix token
        time = (_dense_leaves("state_proj", "state_proj", lambda c: (c.action_dim, da(c)))
                + _dense_leaves("action_time_mlp_in", "time_mlp_in", lambda c: (2 * da(c), da(c)))
                + _dense_leaves("action_time_mlp_out", "time_mlp_out", lambda c: (da(c), da(c))))
    return tuple(
        [_Leaf("PaliGemma/llm/embedder/input_embedding", ("embedding",), lambda c: (c.vocab_size, c.vlm.width), "embed")]
        + _expert_leaves("", "vlm", "", lambda c: c.vlm, adaptive=False)
        + _expert_leaves("", "action_expert", "_1", lambda c: c.action_expert, adaptive=pi05)
        + _siglip_leaves()
        + _dense_leaves("action_in_proj", "action_in", lambda c: (c.action_dim, da(c)))
        + time
        + _dense_leaves("action_out_proj", "action_out", lambda c: (da(c), c.action_dim))
    )


_SPECS = {"pi05": _variant_leaves(True), "pi0": _variant_leaves(False)}
_SPECS["pi0_fast"] = tuple(  # π0-FAST: the PaliGemma rows of the table only (no `_1` expert, no projections)
    [_Leaf("PaliGemma/llm/embedder/input_embedding", ("embedding",), lambda c: (c.vocab_size, c.vlm.width), "embed")]
    + _expert_leaves("", "vlm", "", lambda c: c.vlm, adaptive=False) + _siglip_leaves())


def _spec(config: ModelConfig) -> tuple[_Leaf, ...]:
    return _SPECS[config.variant]


def openpi_paths(config: ModelConfig) -> tuple[str, ...]:
    """Every openpi parameter path of `config`'s variant (51 for π0.5, 50 for π0, 32 for π0-FAST), in table order."""
    return tuple(leaf.openpi for leaf in _spec(config))


OPENPI_PATHS: tuple[str, ...] = tuple(leaf.openpi for leaf in _SPECS["pi05"])
"""Every openpi parameter path of π0.5 (51), in table order (`openpi_paths` for either variant)."""


LAYER_STACKED: frozenset[str] = frozenset(leaf.openpi for spec in _SPECS.values() for leaf in spec if "layers" in leaf.attr)
"""The openpi paths (of either variant) whose leaves carry a leading layer axis L."""


def variant_of(paths) -> str:
    """Which variant a set of openpi paths holds: "pi0" when it has π0's `state_proj`, else "pi05"."""
    return "pi0" if "state_proj/kernel" in set(paths) else "pi05"


def openpi_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every openpi parameter path for `config`."""
    return {leaf.openpi: tuple(leaf.shape(config)) for leaf in _spec(config)}


def _build(values: dict[tuple[str, ...], jax.Array], config: ModelConfig) -> Params:
    """Assembles `Params` from a flat {attr path: leaf} dict."""

    def dense(p):
        return Dense(kernel=values[p + ("kernel",)], bias=values[p + ("bias",)])

    def norm(p):
        if p + ("scale",) in values:
            return RMSNorm(scale=values[p + ("scale",)])
        return AdaRMSNorm(modulation=dense(p + ("modulation",)))

    def lnorm(p):
        return LayerNorm(scale=values[p + ("scale",)], bias=values[p + ("bias",)])

    def expert(name):
        p = (name, "layers")
        layers = ExpertLayers(
            q=values[p + ("q",)], kv=values[p + ("kv",)], out=values[p + ("out",)],
            attn_norm=norm(p + ("attn_norm",)), ffw_norm=norm(p + ("ffw_norm",)),
            gating=values[p + ("gating",)], linear=values[p + ("linear",)],
        )
        return Expert(layers=layers, final_norm=norm((name, "final_norm")))

    sl = ("siglip", "layers")
    siglip = Siglip(
        patch=dense(("siglip", "patch")), pos_embedding=values[("siglip", "pos_embedding")],
        layers=SiglipLayers(
            ln0=lnorm(sl + ("ln0",)), query=dense(sl + ("query",)), key=dense(sl + ("key",)),
            value=dense(sl + ("value",)), out=dense(sl + ("out",)), ln1=lnorm(sl + ("ln1",)),
            mlp_in=dense(sl + ("mlp_in",)), mlp_out=dense(sl + ("mlp_out",)),
        ),
        norm=lnorm(("siglip", "norm")), head=dense(("siglip", "head")),
    )
    if config.variant == "pi0_fast":
        return Pi0FastParams(embedding=values[("embedding",)], vlm=expert("vlm"), siglip=siglip, config=config)
    return Params(
        embedding=values[("embedding",)], vlm=expert("vlm"), action_expert=expert("action_expert"),
        siglip=siglip, action_in=dense(("action_in",)), time_mlp_in=dense(("time_mlp_in",)),
        time_mlp_out=dense(("time_mlp_out",)), action_out=dense(("action_out",)), config=config,
        state_proj=dense(("state_proj",)) if ("state_proj", "kernel") in values else None,
    )


def _get(params: Params, attr: tuple[str, ...]):
    for a in attr:
        params = getattr(params, a)
    return params


def _init_leaf(leaf: _Leaf, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    kind = leaf.init
    normal = lambda: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    if kind.startswith("fan_in:"):
        axes = [int(a) % len(shape) for a in kind[len("fan_in:"):].split(",")]
        return normal() / np.float32(math.sqrt(math.prod(shape[a] for a in axes)))
    if kind == "embed":  # table * sqrt(D) has unit scale, and tied logits have unit scale too
        return normal() / np.float32(math.sqrt(shape[-1]))
    if kind == "small":
        return np.float32(0.1) * normal()
    if kind == "one":
        return np.float32(1.0) + np.float32(0.1) * normal()
    if kind == "pos":
        return np.float32(0.02) * normal()
    if kind == "gate_bias":  # (scale, shift, gate): an open gate so the action expert is not an identity
        x = np.float32(0.1) * normal()
        x[..., 2 * (shape[-1] // 3):] += 1.0
        return x
    raise AssertionError(kind)


def init_params(config: ModelConfig, seed: int | jax.Array = 0) -> Params:
    """Random parameters from a seed (an int or a JAX PRNG key), in `config.dtype`.

    Every leaf is random (norm scales, biases and adaRMS modulations included; adaRMS gates open
    around 1), so tests and benchmarks exercise the whole network. This is not openpi's training
    initialisation, which zero-initialises the adaRMS modulations (an identity action expert);
    fine-tuning starts from a restored checkpoint instead. Drawn with numpy (leaf i from
    PCG64([seed, i])): deterministic everywhere and free of per-shape compilation.
    """
    if isinstance(seed, jax.Array):
        seed = int(np.asarray(jax.random.key_data(seed) if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) else seed).sum())
    dtype = config.jnp_dtype
    values = {}
    for i, leaf in enumerate(_spec(config)):
        rng = np.random.default_rng([int(seed), i])
        values[leaf.attr] = jnp.asarray(_init_leaf(leaf, tuple(leaf.shape(config)), rng), dtype)
    return _build(values, config)


def abstract_params(config: ModelConfig) -> Params:
    """`jax.ShapeDtypeStruct` leaves for `config`, without allocating anything."""
    dtype = config.jnp_dtype
    return _build({leaf.attr: jax.ShapeDtypeStruct(tuple(leaf.shape(config)), dtype) for leaf in _spec(config)}, config)


def _map_layer_stacks(params: Params, fn) -> Params:
    def expert(e: Expert) -> Expert:
        return dataclasses.replace(e, layers=fn(e.layers))

    more = {} if isinstance(params, Pi0FastParams) else {"action_expert": expert(params.action_expert)}
    return dataclasses.replace(
        params, vlm=expert(params.vlm), **more,
        siglip=dataclasses.replace(params.siglip, layers=fn(params.siglip.layers)),
    )


def unstack_layers(params: Params) -> Params:
    """The same parameters with every layer stack split into separate per-layer buffers.

    Use on CPUs (see `nn.layers.scan_layers`); `stack_layers` inverts it. Outputs are unchanged.
    """
    return _map_layer_stacks(params, nn_layers.unstack_layers)


def stack_layers(params: Params) -> Params:
    """Inverse of `unstack_layers` (a no-op on stacked parameters)."""
    return _map_layer_stacks(params, nn_layers.stack_layers)


def for_backend(params: Params, backend: str | None = None) -> Params:
    """Unstacked layers on the CPU backend, stacked (scanned) elsewhere."""
    backend = backend or jax.default_backend()
    return unstack_layers(params) if backend == "cpu" else stack_layers(params)


def to_openpi_dict(params: Params) -> dict[str, jax.Array]:
    """Flat {openpi path: array} view of `params` (the layout openpi's `restore_params` returns)."""
    params = stack_layers(params)
    return {leaf.openpi: _get(params, leaf.attr) for leaf in _spec(params.config)}


def from_openpi_dict(flat: dict[str, jax.Array], config: ModelConfig, *, consume: bool = False) -> Params:
    """Builds `Params` from a flat {openpi path: array} dict, checking keys and shapes.

    Leaves are converted to `config.dtype`. `consume=True` empties `flat` leaf by leaf as each is
    converted (and waits for each copy), so a restore holding the only references to host arrays
    frees each as soon as its device copy exists: the weights are never held twice.

    Raises:
      ValueError: listing every missing key, every unexpected key and every mis-shaped key.
    """
    expected = openpi_shapes(config)
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    misshaped = sorted(
        f"{k}: expected {expected[k]}, got {tuple(flat[k].shape)}"
        for k in expected.keys() & flat.keys()
        if tuple(flat[k].shape) != expected[k]
    )
    if missing or unexpected or misshaped:
        name = {"pi05": "π0.5", "pi0": "π0", "pi0_fast": "π0-FAST"}[config.variant]
        lines = [f"parameters do not match the {name} tree for this config:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if items:
                lines.append(f"  {title} ({len(items)}):")
                lines += [f"    {i}" for i in items]
        raise ValueError("\n".join(lines))
    if not consume:
        return _build({leaf.attr: _as_dtype(flat[leaf.openpi], config.jnp_dtype) for leaf in _spec(config)}, config)
    values = {}
    for leaf in _spec(config):
        values[leaf.attr] = jax.block_until_ready(_as_dtype(flat.pop(leaf.openpi), config.jnp_dtype))
    return _build(values, config)


def from_layer_pieces(values: dict[str, jax.Array | list[jax.Array]], config: ModelConfig) -> Params:
    """`Params` from converted leaves (keys and shapes already checked, e.g. by a streaming restore).

    A path in `LAYER_STACKED` may map to a list of its per-layer arrays instead of the stacked
    array; every stack given that way becomes `Unstacked` (the CPU layout, `unstack_layers`), and
    no stacked copy is ever made. A stack's leaves must all be given the same way.
    """
    built = _build({leaf.attr: values[leaf.openpi] for leaf in _spec(config)}, config)
    is_list = lambda x: isinstance(x, list)  # noqa: E731

    def unstack(layers):
        kinds = {is_list(x) for x in jax.tree.leaves(layers, is_leaf=is_list)}
        if kinds == {False}:
            return layers
        if kinds != {True}:
            raise ValueError("a layer stack mixes stacked arrays and per-layer lists")
        depth = len(jax.tree.leaves(layers, is_leaf=is_list)[0])
        return nn_layers.Unstacked(layers=tuple(
            jax.tree.map(lambda x, i=i: x[i], layers, is_leaf=is_list) for i in range(depth)))

    return _map_layer_stacks(built, unstack)


def _as_dtype(x, dtype):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype)
    return jnp.asarray(x, dtype)
