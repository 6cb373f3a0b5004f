"""openpi π0-FAST checkpoints (`pi0_fast_base`, `pi0_fast_droid`, fine-tunes) and the FAST processor folder.

A π0-FAST `params/` item is an openpi checkpoint like π0.5's (`ckpts.openpi`: released or training layout,
every leaf streamed, value-checked and cast) whose tree is PaliGemma alone: `PaliGemma/img/*` (SigLIP) and
`PaliGemma/llm/{embedder, layers, final_norm}`, with no `_1` expert and no action projections
(`openpi.is_pi0_fast`). The dimensions are read off the shapes (`infer_fast_config`); the leaves are the
PaliGemma rows of π0.5's table (`models.pi05.params`, variant "pi0_fast").

The FAST codec is not in the checkpoint: openpi downloads the processor `physical-intelligence/fast`
(tokenizer.json, processor_config.json and a Python file for `trust_remote_code`). Put that folder beside the
checkpoint as `fast_tokenizer/` (`find_fast_tokenizer`); `load_fast_codec` reads its two data files, bounded
(`limits.read_json`, `limits.read_text` at `text_tokenizers.MAX_TOKENIZER_BYTES`), and never imports the
Python file. The chunk's horizon and action dim come from processor_config.json (`time_horizon`,
`action_dim`) where it names them, else from the caller (openpi: the model config's).

`load_openpi_fast` gathers what a command needs: config, parameters in the backend's layout, the codec (or
what to fetch), the norm statistics in `assets/`.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

import jax
import numpy as np

from oxygen_jax.ckpts import limits, openpi_lora
from oxygen_jax.ckpts.openpi import (
    MAX_ABS_WEIGHT, EmbedScale, Layout, _infer_expert, _infer_siglip, _OpenpiItem, _read_openpi_metadata, _resolve_layout,
    _shape, _stored_dtype, _stream_params, is_pi0_fast, load_openpi_norm_stats,
)
from oxygen_jax.ckpts.orbax_io import PathLike, resolve_params_item
from oxygen_jax.models.pi05.config import DType, Pi0FastConfig
from oxygen_jax.models.pi05.params import Pi0FastParams, from_openpi_dict, openpi_paths, stack_layers, unstack_layers
from oxygen_jax.robots.fast import FastCodec
from oxygen_jax.robots.normalize import NormStats
from oxygen_jax.robots.text_tokenizers import MAX_TOKENIZER_BYTES

FAST_TOKENIZER_DIR = "fast_tokenizer"
"""The FAST processor folder looked for in or beside a π0-FAST checkpoint (`find_fast_tokenizer`)."""
FAST_TOKENIZER_HINT = ("fast_tokenizer/, the FAST processor folder (tokenizer.json and processor_config.json of the "
                       "Hugging Face repo physical-intelligence/fast, which openpi downloads)")
_EMBEDDER = "PaliGemma/llm/embedder/input_embedding"


def infer_fast_config(shapes: Mapping[str, Iterable[int]], *, dtype: DType = "float32") -> Pi0FastConfig:
    """A `Pi0FastConfig` from openpi parameter shapes (the VLM from `q_einsum` / `kv_einsum` / `gating_einsum`,
    SigLIP as for π0.5, the vocabulary from the embedder); one-line ValueError naming the key at fault."""
    vlm, _ = _infer_expert(shapes, "")
    vocab = _shape(shapes, _EMBEDDER, 2, "[V, D]")[0]
    try:
        return Pi0FastConfig(vlm=vlm, siglip=_infer_siglip(shapes), vocab_size=vocab, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"checkpoint shapes give an invalid Pi0FastConfig: {e}") from e


def is_fast_checkpoint(path: PathLike) -> bool:
    """Whether an openpi checkpoint (root, step or `params` item) holds π0-FAST's tree, from its metadata alone."""
    return is_pi0_fast(_read_openpi_metadata(resolve_params_item(path))[0])


def _open_fast(path: PathLike, dtype: DType, embed_scale: EmbedScale = "stored") -> _OpenpiItem:
    """Reads the metadata, infers the config and checks every key and shape before any array is read."""
    if embed_scale not in ("stored", "restored"):
        raise ValueError(f"embed_scale must be 'stored' or 'restored', got {embed_scale!r}")
    item = resolve_params_item(path)
    meta, has_value = _read_openpi_metadata(item)
    if not is_pi0_fast(meta):
        raise ValueError(f"openpi checkpoint {item} is not a π0-FAST model (it has an action expert's leaves): "
                         "load it with oxygen_jax.ckpts.openpi.load_openpi_params")
    lora = sorted(k for k in meta if openpi_lora.is_lora_path(k))
    if lora:
        raise ValueError(f"openpi checkpoint {item} holds {len(lora)} LoRA leaves (e.g. {lora[0]}): merging LoRA into "
                         "a π0-FAST model is not supported yet; merge them with openpi and save the merged params")
    shapes = {k: tuple(m.shape) for k, m in meta.items()}
    try:
        config = infer_fast_config(shapes, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"openpi π0-FAST checkpoint {item}: {e}") from e
    if embed_scale == "stored" and _stored_dtype(meta, _EMBEDDER) == "bfloat16" and dtype != "bfloat16":
        config = config.replace(embed_scale_dtype="bfloat16")  # openpi's sqrt(D) rounded as stored (`ckpts.openpi`)
    np_dtype = np.dtype(config.jnp_dtype)
    try:
        from_openpi_dict({k: jax.ShapeDtypeStruct(shapes[k], np_dtype) for k in openpi_paths(config) if k in meta},
                         config)
    except ValueError as e:
        raise ValueError(f"openpi checkpoint {item}: {e}") from e
    return _OpenpiItem(item=item, meta=meta, has_value=has_value, config=config, lora_paths=())


def read_openpi_fast_config(path: PathLike, dtype: DType = "float32") -> Pi0FastConfig:
    """The `Pi0FastConfig` of an openpi π0-FAST checkpoint from its metadata alone (keys and shapes checked)."""
    return _open_fast(path, dtype).config


def load_openpi_fast_params(path: PathLike, *, dtype: DType = "float32", max_abs: float | None = MAX_ABS_WEIGHT,
                            embed_scale: EmbedScale = "stored",
                            layout: Layout = "backend") -> tuple[Pi0FastConfig, Pi0FastParams]:
    """Restores an openpi π0-FAST checkpoint (either layout), every leaf cast to `dtype`.

    Arguments as `ckpts.openpi.load_openpi_params` (no LoRA: a checkpoint with LoRA leaves is refused). Keys and
    shapes are checked from the metadata first; each leaf is then streamed, checked for NaN/inf and
    |x| > `max_abs`, and cast straight into its final buffers.

    Returns:
      (config inferred from the stored shapes, `Pi0FastParams` in `layout`).
    Raises:
      FileNotFoundError, CheckpointError, ValueError: as `load_openpi_params` (one line first), and a π0 / π0.5
        checkpoint (pointing to `load_openpi_params`).
    """
    unstacked = _resolve_layout(layout) == "unstacked"
    ck = _open_fast(path, dtype, embed_scale)
    np_dtype = np.dtype(ck.config.jnp_dtype)
    if (ck.item / "manifest.ocdbt").is_file():
        return ck.config, _stream_params(ck, np_dtype, unstacked, max_abs)
    arrays = ck.restore({k: np_dtype for k in openpi_paths(ck.config)}, max_abs)  # an older (non-OCDBT) item
    params = from_openpi_dict(arrays, ck.config, consume=True)
    return ck.config, unstack_layers(params) if unstacked else stack_layers(params)


def find_fast_tokenizer(checkpoint: PathLike) -> Path | None:
    """`fast_tokenizer/` in the checkpoint root (or step) directory, or beside its `params` item; None if absent."""
    p = Path(checkpoint).expanduser().resolve()
    for d in (p, p.parent):
        if (d / FAST_TOKENIZER_DIR).is_dir():
            return d / FAST_TOKENIZER_DIR
    return None


def _processor_number(config: Mapping[str, Any], field: str, where: str, *, cap: int | None, low: int = 1,
                      optional: bool = False) -> int | None:
    if field not in config or config[field] is None:
        if optional:
            return None
        raise ValueError(f"{where}: no {field!r} (a FAST processor config names scale, vocab_size and min_token)")
    return limits.int_field(config[field], field, where, cap=cap, low=low)


def load_fast_codec(folder: PathLike) -> FastCodec:
    """The FAST codec of a processor folder: `processor_config.json` (scale, vocab_size, min_token, and
    time_horizon / action_dim when it names them) and the byte-level BPE of `tokenizer.json`.

    Both files are bounded and must be regular files; anything the `tokenizers` package raises on the JSON is
    one ValueError naming the file. The folder's Python file is never imported.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"FAST processor folder not found: {folder} (fetch {FAST_TOKENIZER_HINT})")
    where = folder / "processor_config.json"
    config = limits.read_json(where)
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    scale = config.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{where}: scale must be a finite number > 0, got {scale!r:.60}")
    vocab = _processor_number(config, "vocab_size", where, cap=limits.MAX_VOCAB)
    min_token = _processor_number(config, "min_token", where, cap=limits.MAX_VOCAB, low=-limits.MAX_VOCAB)
    horizon = _processor_number(config, "time_horizon", where, cap=limits.MAX_HORIZON, optional=True)
    action_dim = _processor_number(config, "action_dim", where, cap=limits.MAX_ACTION_DIM, optional=True)
    tokenizer_file = folder / "tokenizer.json"
    text = limits.read_text(tokenizer_file, MAX_TOKENIZER_BYTES)
    try:
        import tokenizers  # noqa: PLC0415 - imported where a tokenizer.json is read, as robots.native_prompts does

        bpe = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception; one line naming the file
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"{tokenizer_file}: not a readable tokenizer ({first})") from None
    return FastCodec(bpe=bpe, scale=float(scale), min_token=min_token, vocab_size=vocab, horizon=horizon,
                     action_dim=action_dim, source=str(folder))


class FastCheckpoint(NamedTuple):
    """What `load_openpi_fast` restores: the network, its FAST codec, its norm statistics.

    Attributes:
      config, params: the model (`models.pi05.pi0_fast`, `pi0_fast_decode`), layers in the requested layout.
      codec: the FAST codec found beside the checkpoint (or given), or None; then `codec_hint` names what to fetch.
      norm_stats: {"state", "actions": NormStats} of `assets/<asset_id>/norm_stats.json`, or None.
      what: one line for messages.
    """

    config: Pi0FastConfig
    params: Pi0FastParams
    codec: FastCodec | None
    codec_hint: str | None
    norm_stats: dict[str, NormStats] | None
    what: str


def load_openpi_fast(path: PathLike, *, dtype: DType = "float32", layout: Layout = "backend",
                     fast_tokenizer: PathLike | None = None, asset_id: str | None = None,
                     max_abs: float | None = MAX_ABS_WEIGHT) -> FastCheckpoint:
    """An openpi π0-FAST checkpoint with its FAST codec and norm statistics (`FastCheckpoint`).

    Args:
      path: the checkpoint root, a step directory or the `params` item (either layout).
      fast_tokenizer: the FAST processor folder; default `find_fast_tokenizer(path)` (None found: no codec).
      asset_id: the norm statistics' asset directory (`load_openpi_norm_stats`; default: the only one).
    """
    config, params = load_openpi_fast_params(path, dtype=dtype, layout=layout, max_abs=max_abs)
    folder = Path(fast_tokenizer) if fast_tokenizer is not None else find_fast_tokenizer(path)
    codec = None if folder is None else load_fast_codec(folder)
    return FastCheckpoint(config=config, params=params, codec=codec,
                          codec_hint=None if codec is not None else FAST_TOKENIZER_HINT,
                          norm_stats=load_openpi_norm_stats(path, asset_id),
                          what=f"openpi π0-FAST checkpoint {Path(path).expanduser()}")
