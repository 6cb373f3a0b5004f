"""openpi π0.5 and π0 checkpoints: config inference, restore (both layouts, LoRA), norm statistics.

An openpi checkpoint (`load_openpi_params`, `load_openpi_lora`) is an orbax PyTree item directory
`params/` whose tree is `{"params": <nested dict>}` with "/"-joined leaf paths such as
`PaliGemma/llm/layers/attn/q_einsum/w` (see `params.openpi_paths`; π0, openpi's `Pi0Config(pi05=False)`,
is recognised by its `state_proj` leaf, `params.variant_of`; π0-FAST, a tree without action projections
(`is_pi0_fast`), is refused here and read by `ckpts.openpi_fast`). Two layouts exist:

- released (`gs://openpi-assets/checkpoints/<model>/params`): plain paths;
- training (`<exp>/<step>/params`, written by an orbax CheckpointManager from an `nnx.State`):
  every leaf path carries an extra trailing `value` component, which is stripped. A LoRA
  fine-tune stores its frozen `PaliGemma/llm` leaves as bfloat16 there; every leaf is cast to
  the requested dtype on restore.

openpi's arithmetic on such bfloat16 leaves, reproduced for any width: its embedder multiplies the
table by sqrt(D) cast to the table's dtype (bfloat16: 45.25 for D = 2048, 6.9375 for D = 48; exact
only when sqrt(D) is a bfloat16 number, e.g. D = 64), so a float32 restore of a bfloat16-stored table
keeps that factor (`ModelConfig.embed_scale_dtype`; `embed_scale="restored"` switches it off). Its
RMSNorm's `1 + scale` with a bfloat16 scale is, under `jit`, computed in float32 (XLA elides the
bfloat16 round trip; only op-by-op execution rounds it), which is what our norm computes from the
upcast scale (tests/test_openpi_arithmetic.py checks both against openpi's formulas under jit, and
tests/test_openpi_widths.py the whole VLM expert against openpi's own outputs at D = 48 and 72). Where sqrt(D)
is not a bfloat16 number, openpi's training layout therefore computes other numbers than its released layout
holding the same values; `embed_scale="restored"` gives the latter.

The model dimensions are not stored anywhere: `infer_model_config` reads them off the shapes.
LoRA leaves (`lora_a` / `lora_b`, 20 for π0.5 with LoRA on both experts) are merged into the
base weights by default, or returned separately by `load_openpi_lora`; ranks are read off their
shapes, alpha is not stored (see `oxygen_jax.models.lora`). Other extra keys are ignored (as openpi
does); missing and mis-shaped keys are errors listing all of them. Norm statistics live beside
the item in `assets/<asset_id>/norm_stats.json` (`load_openpi_norm_stats`).

openpi checkpoints carry no checksums: damage is caught by `orbax_io` (unreadable files) and by
`orbax_io.check_values` (non-finite values, |x| > `MAX_ABS_WEIGHT`).

Memory: `load_openpi_params` streams each leaf from disk into its final layout (`leaf_stream`: the
per-layer buffers on the CPU, the stacked arrays elsewhere), so the weights exist once and the
transient is a few tens of MiB; LoRA leaves are read first (small) and each target weight is read in float32 and
merged as it streams, layer by layer in the CPU layout (`_leaf_pieces`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

from oxygen_jax.ckpts.leaf_stream import LeafReader, mapped_pieces
from oxygen_jax.ckpts.orbax_io import (
    PathLike, check_values, is_pytree_item, read_tree_metadata, resolve_params_item, restore_arrays,
)
from oxygen_jax.ckpts import openpi_lora
from oxygen_jax.models import lora as lora_lib
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.config import DType, ExpertConfig, ModelConfig, PromptAttention, model_config
from oxygen_jax.models.pi05.params import (
    LAYER_STACKED, Params, from_layer_pieces, from_openpi_dict, openpi_paths, stack_layers, unstack_layers, variant_of,
)
from oxygen_jax.models.vision.siglip import SiglipConfig
from oxygen_jax.robots.normalize import NormStats, load_norm_stats


_LLM = "PaliGemma/llm"
_IMG = "PaliGemma/img"
_BLOCK = f"{_IMG}/Transformer/encoderblock"

MAX_ABS_WEIGHT = 1e4
"""Largest |value| accepted in an openpi checkpoint leaf (`load_openpi_params(max_abs=...)`).

Trained transformer weights are O(1): projection and embedding entries are ~1e-2..1, norm scales
and biases at most O(10..100) (Gemma's RMSNorm scales are its largest). 1e4 leaves two orders of
magnitude of headroom above that, while a corrupted float32/bfloat16 exponent bit (the effect of
the flipped bytes this guards against) moves a value by a factor of 2^64..2^128 (≈ 1e17..1e38)
or makes it NaN/inf. It has not been checked against every released checkpoint: if a real leaf
exceeds it, pass a larger `max_abs` (or None to skip the check) and report it.
"""


# ---------------------------------------------------------------------------------------------
# Config inference
# ---------------------------------------------------------------------------------------------


def _shape(shapes: Mapping[str, Iterable[int]], key: str, rank: int, layout: str) -> tuple[int, ...]:
    """The shape stored under `key`, which must exist and have `rank` axes (named in `layout`)."""
    if key not in shapes:
        raise ValueError(f"cannot infer the model config: missing key {key!r}")
    shape = tuple(int(d) for d in shapes[key])
    if len(shape) != rank:
        raise ValueError(f"cannot infer the model config: {key!r} has shape {shape}, expected {layout}")
    return shape


def _infer_expert(shapes: Mapping[str, Iterable[int]], sfx: str) -> tuple[ExpertConfig, dict[str, str]]:
    q_key = f"{_LLM}/layers/attn/q_einsum{sfx}/w"
    kv_key = f"{_LLM}/layers/attn/kv_einsum{sfx}/w"
    mlp_key = f"{_LLM}/layers/mlp{sfx}/gating_einsum"
    depth, heads, width, head_dim = _shape(shapes, q_key, 4, "[L, N, D, H]")
    kv_heads = _shape(shapes, kv_key, 5, "[L, 2, K, D, H]")[2]
    mlp_dim = _shape(shapes, mlp_key, 4, "[L, 2, D, F]")[3]
    # Which key each field was read from, for error messages.
    source = {"depth": q_key, "num_heads": q_key, "head_dim": q_key, "num_kv_heads": kv_key}
    try:
        expert = ExpertConfig(
            width=width, depth=depth, mlp_dim=mlp_dim, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim
        )
    except ValueError as e:
        raise ValueError(f"invalid expert dimensions from {q_key!r}, {kv_key!r}, {mlp_key!r}: {e}") from e
    return expert, source


def _infer_siglip(shapes: Mapping[str, Iterable[int]]) -> SiglipConfig:
    stem_key = f"{_IMG}/embedding/kernel"
    q_key = f"{_BLOCK}/MultiHeadDotProductAttention_0/query/kernel"
    mlp_key = f"{_BLOCK}/MlpBlock_0/Dense_0/kernel"
    pos_key = f"{_IMG}/pos_embedding"
    ph, pw, channels, width = _shape(shapes, stem_key, 4, "[p, p, 3, W] (HWIO)")
    if ph != pw or channels != 3:
        raise ValueError(
            f"{stem_key!r} has shape {(ph, pw, channels, width)}: expected a square RGB patch [p, p, 3, W]"
        )
    depth, q_width, heads, head_dim = _shape(shapes, q_key, 4, "[L, W, Nv, Hv]")
    if q_width != width:
        raise ValueError(f"{q_key!r} has width {q_width} but {stem_key!r} has width {width}")
    if heads * head_dim != width:
        # SiglipConfig has no head_dim field: it derives head_dim = width // num_heads.
        raise ValueError(
            f"{q_key!r} has shape {(depth, q_width, heads, head_dim)}: SigLIP head_dim {head_dim} x heads {heads} "
            f"!= width {width}; SiglipConfig derives head_dim = width // num_heads and cannot represent this"
        )
    mlp_dim = _shape(shapes, mlp_key, 3, "[L, W, Fv]")[2]
    num_patches = _shape(shapes, pos_key, 3, "[1, Np, W]")[1]
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(f"{pos_key!r} has {num_patches} patches, not a square grid: cannot infer image_size")
    try:
        return SiglipConfig(
            width=width, depth=depth, mlp_dim=mlp_dim, num_heads=heads, patch_size=ph, image_size=side * ph
        )
    except ValueError as e:
        keys = ", ".join(repr(k) for k in (stem_key, q_key, mlp_key, pos_key))
        raise ValueError(f"invalid SigLIP dimensions from {keys}: {e}") from e


def infer_model_config(
    shapes: Mapping[str, Iterable[int]],
    *,
    dtype: DType = "float32",
    prompt_attention: PromptAttention = "bidirectional",
) -> ModelConfig:
    """Infers a π0.5 `ModelConfig` from openpi parameter shapes.

    Each dimension is read from one key (Gemma experts from `q_einsum`/`kv_einsum`/`gating_einsum`,
    vocabulary from the embedder, SigLIP from the stem kernel, the stacked query kernel, the first
    MLP kernel and `pos_embedding`, action_dim from `action_in_proj`). The remaining keys are not
    cross-checked here: pass the shapes to `from_openpi_dict` or `check_manifest` for that, which
    list every mismatch with both shapes.

    Args:
      shapes: {openpi path: shape}, paths as in `params.openpi_paths` (no `params/` prefix, no
        trailing `value`). Extra keys are ignored; a `state_proj` leaf makes it π0 (`variant` "pi0").
      dtype: `ModelConfig.dtype` of the result.
      prompt_attention: `ModelConfig.prompt_attention` of the result.

    Raises:
      ValueError: naming the key that is missing, has the wrong rank, or disagrees with another.

    Example: `infer_model_config(openpi_shapes(model_config("pi05")))` == `model_config("pi05")`.
    """
    vlm, vlm_src = _infer_expert(shapes, "")
    act, act_src = _infer_expert(shapes, "_1")
    for field, key in vlm_src.items():
        a, b = getattr(vlm, field), getattr(act, field)
        if a != b:
            raise ValueError(
                f"the experts attend jointly and must share {field}: {key!r} gives {a}, {act_src[field]!r} gives {b}"
            )
    emb_key = f"{_LLM}/embedder/input_embedding"
    vocab = _shape(shapes, emb_key, 2, "[V, D]")[0]
    action_dim = _shape(shapes, "action_in_proj/kernel", 2, "[A, D_act]")[0]
    siglip = _infer_siglip(shapes)
    try:
        return ModelConfig(
            vlm=vlm, action_expert=act, siglip=siglip, vocab_size=vocab, action_dim=action_dim,
            dtype=dtype, prompt_attention=prompt_attention, variant=variant_of(shapes),
        )
    except ValueError as e:
        raise ValueError(f"checkpoint shapes give an invalid ModelConfig: {e}") from e


# ---------------------------------------------------------------------------------------------
# Restore
# ---------------------------------------------------------------------------------------------


def is_pi0_fast(paths: Iterable[str]) -> bool:
    """Whether openpi parameter paths are π0-FAST's: PaliGemma's embedder and no action projections (no expert)."""
    paths = set(paths)
    return f"{_LLM}/embedder/input_embedding" in paths and not any(k.startswith("action_in_proj/") for k in paths)


def _read_openpi_metadata(item: Path) -> tuple[dict[str, Any], bool]:
    """({openpi path: array metadata}, whether stored paths carry a trailing `value`)."""
    tree = read_tree_metadata(item)
    if "params" not in tree or not isinstance(tree["params"], Mapping):
        raise ValueError(f"orbax checkpoint {item} has no 'params' entry at the top of its tree (found: {sorted(tree)})")
    flat = flatten_dict(tree["params"])
    if not flat:
        raise ValueError(f"orbax checkpoint {item} has an empty 'params' tree")
    # nnx.State serialisation appends `value` to every leaf; only strip when all leaves have it.
    has_value = all(len(k) > 1 and k[-1] == "value" for k in flat)
    if has_value:
        flat = {k[:-1]: v for k, v in flat.items()}
    return {"/".join(k): v for k, v in flat.items()}, has_value


def _missing_report(missing: list[str]) -> str:
    return f"  missing ({len(missing)}):\n" + "\n".join(f"    {k}" for k in missing)


@dataclasses.dataclass(frozen=True)
class _OpenpiItem:
    item: Path
    meta: dict[str, Any]  # {openpi path: array metadata}
    has_value: bool
    config: ModelConfig
    lora_paths: tuple[str, ...]

    def restore(self, dtypes: Mapping[str, Any], max_abs: float | None) -> dict[str, np.ndarray]:
        """{openpi path: host array} for the paths in `dtypes` (each cast to its dtype), value-checked."""
        suffix = ("value",) if self.has_value else ()
        stored = {("params", *k.split("/"), *suffix): dt for k, dt in dtypes.items()}
        flat = restore_arrays(self.item, stored, partial=len(stored) < len(self.meta))
        arrays = {"/".join(k[1 : len(k) - len(suffix)]): v for k, v in flat.items()}
        check_values(self.item, arrays, max_abs)
        return arrays


EmbedScale = Literal["stored", "restored"]
_NAMES = {"pi05": "π0.5", "pi0": "π0"}


def _stored_dtype(meta: Mapping[str, Any], key: str) -> str | None:
    dt = getattr(meta.get(key), "dtype", None)
    return None if dt is None else np.dtype(dt).name


def _open_openpi(path: PathLike, dtype: DType, prompt_attention: PromptAttention,
                 embed_scale: EmbedScale = "stored") -> _OpenpiItem:
    """Reads the metadata, infers the config and checks every key and shape (LoRA included)."""
    if embed_scale not in ("stored", "restored"):
        raise ValueError(f"embed_scale must be 'stored' or 'restored', got {embed_scale!r}")
    item = resolve_params_item(path)
    meta, has_value = _read_openpi_metadata(item)
    if is_pi0_fast(meta):
        raise ValueError(f"openpi checkpoint {item} is a π0-FAST model (one PaliGemma decoding FAST action tokens, no "
                         "action expert): load it with oxygen_jax.ckpts.openpi_fast.load_openpi_fast; this reader "
                         "restores π0 and π0.5")
    variant = variant_of(meta)
    paths = openpi_paths(model_config("tiny", variant=variant))  # the variant's path list (dims do not matter)
    missing = [k for k in paths if k not in meta]
    shapes = {k: tuple(m.shape) for k, m in meta.items()}
    try:
        config = infer_model_config(shapes, dtype=dtype, prompt_attention=prompt_attention)
        stored = _stored_dtype(meta, f"{_LLM}/embedder/input_embedding")
        if embed_scale == "stored" and stored == "bfloat16" and dtype != "bfloat16":
            config = config.replace(embed_scale_dtype="bfloat16")  # openpi's sqrt(D) factor (module docstring)
    except ValueError as e:
        if missing:  # report every missing key, not only the first one inference tripped on
            report = _missing_report(missing)
            raise ValueError(f"openpi checkpoint {item} does not match the {_NAMES[variant]} tree:\n{report}") from e
        raise ValueError(f"openpi checkpoint {item}: {e}") from e
    # Check keys and shapes from the metadata before reading any array.
    np_dtype = np.dtype(config.jnp_dtype)
    try:
        from_openpi_dict({k: jax.ShapeDtypeStruct(shapes[k], np_dtype) for k in paths if k in meta}, config)
    except ValueError as e:
        raise ValueError(f"openpi checkpoint {item}: {e}") from e
    lora_problems = openpi_lora.check_openpi_shapes(shapes, config)
    if lora_problems:
        lines = "\n".join(f"    {p}" for p in lora_problems)
        raise ValueError(f"openpi checkpoint {item}: LoRA leaves do not fit the model:\n{lines}")
    lora_paths = tuple(sorted(k for k in meta if openpi_lora.is_lora_path(k)))
    return _OpenpiItem(item=item, meta=meta, has_value=has_value, config=config, lora_paths=lora_paths)


def read_openpi_config(path: PathLike, dtype: DType = "float32") -> ModelConfig:
    """The `ModelConfig` of an openpi checkpoint, from its metadata alone (keys and shapes checked, no array read)."""
    return _open_openpi(path, dtype, "bidirectional").config


LoraMode = Literal["merge", "ignore"]
Layout = Literal["backend", "stacked", "unstacked"]


def _resolve_layout(layout: str) -> str:
    if layout not in ("backend", "stacked", "unstacked"):
        raise ValueError(f"layout must be 'backend', 'stacked' or 'unstacked', got {layout!r}")
    if layout == "backend":  # as `params.for_backend` lays them out
        return "unstacked" if jax.default_backend() == "cpu" else "stacked"
    return layout


def _stream_params(ck: _OpenpiItem, dtype: np.dtype, unstacked: bool, max_abs: float | None,
                   adapters: pi05_lora.ModelLora | None = None) -> Params:
    """Every leaf streamed from disk into its final buffers (one per layer when `unstacked`), `adapters` merged into
    their target weights as they stream (`_leaf_pieces`)."""
    paths = openpi_paths(ck.config)
    shapes = {k: tuple(ck.meta[k].shape) for k in paths}
    split = {k for k in paths if unstacked and k in LAYER_STACKED}
    piece = lambda k: math.prod(shapes[k][1:] if k in split else shapes[k]) * np.dtype(ck.meta[k].dtype).itemsize  # noqa: E731
    read, values = _leaf_pieces(ck, adapters, max_abs), {}
    # A host piece and its device copy coexist for a moment: the largest pieces go first, while least is resident.
    with mapped_pieces():
        for k in sorted(paths, key=piece, reverse=True):
            pieces = read(k, dtype, k in split)
            # device_put copies once (jnp.asarray stages a second host copy); each host piece is freed once copied.
            arrays = [jax.block_until_ready(jax.device_put(p)) for p in pieces]
            values[k] = arrays if k in split else arrays[0]
    return from_layer_pieces(values, ck.config)


def float_leaf_reader(path: PathLike, dtype: DType = "float32"):
    """(config, read) for reading an openpi π0.5 / π0 item one leaf at a time, or None where `load_openpi_params`
    restores it otherwise (an item without an OCDBT manifest).

    `read(openpi path, per_layer)` yields the leaf cast to `dtype` and value-checked (`MAX_ABS_WEIGHT`), whole or,
    with `per_layer`, its layers one at a time (`leaf_stream.LeafReader.pieces`); LoRA leaves are merged into their
    target weights as `load_openpi_params` merges them by default (alpha = rank). The config is the one
    `load_openpi_params(path, dtype=dtype)` returns.
    """
    ck = _open_openpi(path, dtype, "bidirectional")
    if not (ck.item / "manifest.ocdbt").is_file():
        return None
    read, np_dtype = _leaf_pieces(ck, _adapters(ck, None, False, MAX_ABS_WEIGHT), MAX_ABS_WEIGHT), np.dtype(ck.config.jnp_dtype)
    return ck.config, lambda k, per_layer: read(k, np_dtype, per_layer)


def _adapters(ck: _OpenpiItem, alpha, rslora: bool, max_abs: float | None) -> pi05_lora.ModelLora | None:
    """The item's LoRA adapters (read whole, float32), or None without LoRA leaves."""
    if not ck.lora_paths:
        return None
    arrays = ck.restore({k: np.dtype(np.float32) for k in ck.lora_paths}, max_abs)
    return openpi_lora.from_openpi(arrays, ck.config, alpha=alpha, rslora=rslora)


def _leaf_pieces(ck: _OpenpiItem, adapters: pi05_lora.ModelLora | None, max_abs: float | None):
    """`read(openpi path, dtype, per_layer)`: the leaf's pieces (`LeafReader.pieces`) in `dtype`; a LoRA target
    weight read in float32 and each piece (layer) merged with its adapter there, then cast: what `merge_openpi`
    computes on the whole stack, the same bits (tests/test_lora.py, tests/test_quant.py)."""
    suffix, reader = ("value",) if ck.has_value else (), LeafReader(ck.item)
    targets = {openpi_lora.openpi_weight_path(t, sfx): (getattr(adapters, field), t)
               for field, sfx in pi05_lora.EXPERTS if adapters is not None and getattr(adapters, field) is not None
               for t in getattr(adapters, field).pairs()}

    def read(k: str, dtype: np.dtype, per_layer: bool):
        key, shape = ("params", *k.split("/"), *suffix), tuple(ck.meta[k].shape)
        if k not in targets:
            yield from reader.pieces(key, k, shape, dtype, per_layer, max_abs)
            return
        adapter, target = targets[k]
        pair = getattr(adapter, target)
        for i, piece in enumerate(reader.pieces(key, k, shape, np.dtype(np.float32), per_layer, max_abs)):
            one = jax.tree.map(lambda x: x[i], pair) if per_layer else pair
            yield np.asarray(_merge_piece(piece, one, target, adapter.scaling, jnp.dtype(dtype)))

    return read


@functools.partial(jax.jit, static_argnames=("target", "scaling", "dtype"))
def _merge_piece(w, pair, target: str, scaling: float, dtype):
    return lora_lib.merge_weight(w, target, pair, scaling).astype(dtype)


def load_openpi_params(
    path: PathLike,
    *,
    dtype: DType = "float32",
    prompt_attention: PromptAttention = "bidirectional",
    lora: LoraMode = "merge",
    lora_alpha: float | Mapping[str, float | None] | None = None,
    lora_rslora: bool = False,
    max_abs: float | None = MAX_ABS_WEIGHT,
    embed_scale: EmbedScale = "stored",
    layout: Layout = "backend",
) -> tuple[ModelConfig, Params]:
    """Restores an openpi π0.5 checkpoint, every leaf cast to `dtype`, in the layout the backend runs.

    Keys and shapes (LoRA leaves included) are checked from the orbax metadata before any array
    is read; each leaf is then streamed from disk in pieces, checked for damage (non-finite values,
    |x| > `max_abs`) and cast, straight into its final buffers (`leaf_stream`), so the weights are
    held once: no stacked copy beside the per-layer one and no float32 copy beside a bfloat16 one.

    Args:
      path: an openpi `params` item directory (released or training layout), or a directory that
        contains one (a training step directory such as `<exp>/<step>`, or a released checkpoint
        root with `params/` and `assets/`). Relative paths are resolved.
      dtype: every leaf is cast to this on restore ("float32" or "bfloat16"), as openpi's
        inference restore does; it is also the returned config's dtype.
      prompt_attention: the returned config's prompt attention ("bidirectional" = openpi).
      lora: what to do with LoRA leaves, if the checkpoint has any. "merge" (default): fold them
        into the base weights (`pi05_lora.merge`, computed in float32 before the cast to `dtype`), which
        gives the model openpi runs; "ignore": return the base weights only. For the adapters as
        a pytree, call `load_openpi_lora` (e.g. with `lora="ignore"` here: base + separate).
      lora_alpha: the alpha the adapters were trained with (not stored in checkpoints): one number
        for both experts, or {"vlm": a0, "action_expert": a1}; None = rank, i.e. scaling 1 (all of
        openpi's LoRA variants). Only the attention LoRA depends on it.
      lora_rslora: the adapters were trained with rank-stabilised scaling (alpha / sqrt(rank)).
      max_abs: refuse leaves with |x| above this (`MAX_ABS_WEIGHT`); None checks finiteness only.
      embed_scale: "stored" (default): token embeddings are scaled by sqrt(D) rounded to the embedding's stored
        dtype, as openpi computes them (a training-layout table is bfloat16: 45.25 for D = 2048, not 45.2548);
        "restored": rounded to `dtype` instead. Only a bfloat16-stored table restored in float32 tells them apart.
      layout: "backend" (default): as `params.for_backend` would lay them out for the default backend
        (per-layer buffers on the CPU, stacked elsewhere), so `for_backend` is then a no-op;
        "stacked" / "unstacked" force one.

    Returns:
      (config inferred from the stored shapes, `Params` built by `from_openpi_dict`, whose leaves
      are arrays in `config.dtype`).

    Raises:
      FileNotFoundError: `path` does not exist.
      CheckpointError: a damaged or incomplete orbax directory, or a leaf holding NaN/inf or
        |x| > max_abs (one line naming the file or leaf).
      ValueError: not an orbax checkpoint, no `params` item, or keys missing / mis-shaped (every
        such key is listed, with expected and stored shapes). Extra non-LoRA keys are ignored.
    """
    if lora not in ("merge", "ignore"):
        raise ValueError(f"lora must be 'merge' or 'ignore', got {lora!r} (adapters as a pytree: load_openpi_lora)")
    unstacked = _resolve_layout(layout) == "unstacked"
    ck = _open_openpi(path, dtype, prompt_attention, embed_scale)
    config = ck.config
    np_dtype = np.dtype(config.jnp_dtype)
    merging = lora == "merge" and bool(ck.lora_paths)
    if (ck.item / "manifest.ocdbt").is_file():  # streamed, LoRA merged layer by layer
        adapters = _adapters(ck, lora_alpha, lora_rslora, max_abs) if merging else None
        return config, _stream_params(ck, np_dtype, unstacked, max_abs, adapters)
    dtypes = {k: np_dtype for k in openpi_paths(config)}
    if merging:  # merge in float32; the merged weights are cast to `dtype` by from_openpi_dict
        targets = {openpi_lora.openpi_weight_path(t, sfx) for _, sfx in pi05_lora.EXPERTS for t in lora_lib.TARGETS}
        dtypes.update({k: np.dtype(np.float32) for k in (*targets, *ck.lora_paths) if k in ck.meta})
    arrays = ck.restore(dtypes, max_abs)
    if merging:
        adapters = openpi_lora.from_openpi(arrays, config, alpha=lora_alpha, rslora=lora_rslora)
        arrays = openpi_lora.merge_openpi(arrays, adapters, dtype=np_dtype)
    flat = {k: arrays.pop(k) for k in openpi_paths(config)}
    del arrays  # `flat` holds the only references: each host array is freed once converted
    params = from_openpi_dict(flat, config, consume=True)
    return config, unstack_layers(params) if unstacked else stack_layers(params)


def load_openpi_lora(
    path: PathLike,
    *,
    dtype: DType = "float32",
    alpha: float | Mapping[str, float | None] | None = None,
    rslora: bool = False,
    max_abs: float | None = MAX_ABS_WEIGHT,
) -> pi05_lora.ModelLora | None:
    """The LoRA adapters of an openpi checkpoint as a pytree, without the base weights.

    `load_openpi_params(path, lora="ignore")` gives the matching base parameters. A VLM bank for
    per-row serving: `pi05_lora.stack_adapters([adapters.vlm], config)`.

    Args:
      path: as for `load_openpi_params` (either layout).
      dtype: leaf dtype of the adapters.
      alpha, rslora: as `lora_alpha`, `lora_rslora` of `load_openpi_params`.
      max_abs: as for `load_openpi_params`.

    Returns:
      `pi05_lora.ModelLora` (an expert without LoRA leaves is None; leaves are openpi's, [L, ...]), or
      None when the checkpoint has no LoRA leaf.
    """
    ck = _open_openpi(path, dtype, "bidirectional")
    if not ck.lora_paths:
        return None
    arrays = ck.restore({k: np.dtype(ck.config.jnp_dtype) for k in ck.lora_paths}, max_abs)
    return openpi_lora.from_openpi(jax.device_put(arrays), ck.config, alpha=alpha, rslora=rslora)


def _assets_dir(checkpoint_dir: Path) -> Path | None:
    """`assets/` inside a checkpoint root / step dir, or beside the `params` item we were handed."""
    if (checkpoint_dir / "assets").is_dir():
        return checkpoint_dir / "assets"
    if is_pytree_item(checkpoint_dir) and (checkpoint_dir.parent / "assets").is_dir():
        return checkpoint_dir.parent / "assets"
    return None


def load_openpi_norm_stats(checkpoint_dir: PathLike, asset_id: str | None = None) -> dict[str, NormStats] | None:
    """Reads `assets/<asset_id>/norm_stats.json` of an openpi checkpoint.

    Args:
      checkpoint_dir: the checkpoint root or step directory (containing `params/` and `assets/`),
        or the `params` item itself (then `assets/` is its sibling).
      asset_id: the asset directory, relative to `assets/` (may contain "/", e.g. a dataset repo id).
        Default: the only one present.

    Returns:
      `normalize.load_norm_stats` of that file ({"state": NormStats, "actions": NormStats}), or None
      when the checkpoint has no norm stats at all (no `assets/`, or no norm_stats.json in it).

    Raises:
      FileNotFoundError: `checkpoint_dir` does not exist, or `asset_id` was given and not found.
      ValueError: several asset ids are present and none was chosen, or the file's statistics are not
        finite and bounded with std >= 0 and q01 <= q99 (`normalize.check_statistics`, one line).
    """
    root = Path(checkpoint_dir).expanduser().resolve()
    if not root.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {root}")
    assets = _assets_dir(root)
    found = (
        sorted(str(p.parent.relative_to(assets)) for p in assets.rglob("norm_stats.json")) if assets else []
    )
    if asset_id is None:
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"{assets} holds norm stats for several asset ids {found}; pass asset_id=")
        asset_id = found[0]
    elif asset_id not in found:
        raise FileNotFoundError(f"no norm_stats.json for asset id {asset_id!r} under {assets or root} (found {found})")
    return load_norm_stats(assets / asset_id / "norm_stats.json")
