"""Language-adapter files: one trained VLM-expert LoRA per directory, checksummed and tied to its base.

Layout of a `save_adapter` directory:

    lora/          orbax PyTree item, openpi's nested LoRA paths, e.g. PaliGemma/llm/layers/attn/q_einsum/lora_a
    adapter.json   format, name, request prompt, rank, alpha, rslora, targets, expert ("vlm"), the base
                   checkpoint's path and fingerprint, each leaf's shape / dtype / SHA-256, optional `extra`

Axes (`oxygen_jax.axes`): L layers (every adapter leaf is stacked [L, ...]), E stored adapters of a bank
(ids 1..E; id 0 = base weights).

`load_bank` gives what an engine needs: `Engine(params, cfg, tok, bank=bank, adapter_names=names)`. The base
fingerprint (`base_fingerprint`, a hash of an `own.save_params` directory's checksums) lets a load
refuse a base the adapter was not trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax.traverse_util import flatten_dict, unflatten_dict

from oxygen_jax.ckpts import openpi_lora
from oxygen_jax.models import lora
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.config import ModelConfig

ADAPTER_FORMAT = 1
DEFAULT_ADAPTER_NAME = "memory"  # the textual-memory adapter (the one the embedded demo serves)


def _sha256(x) -> str:
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()


def tree_digest(tree) -> str:
    """SHA-256 over every leaf's bytes (tree order): equal digests mean bit-identical leaves."""
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(_sha256(jax.device_get(x)).encode())
    return h.hexdigest()


def base_fingerprint(base_dir: str | os.PathLike) -> str | None:
    """SHA-256 of an `own.save_params` directory's checksums item (identifies its arrays), or None."""
    path = Path(base_dir) / "checksums" / "metadata"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def save_adapter(
    path: str | os.PathLike,
    adapter: lora.ExpertLora,
    *,
    prompt: str,
    name: str = DEFAULT_ADAPTER_NAME,
    base: str | os.PathLike | None = None,
    extra: Mapping | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes one VLM-expert adapter (leaves [L, ...]) to the new directory `path` (layout: module docstring).

    Args:
      prompt: the request prompt the adapter was trained to answer (e.g. "Memory: ").
      base: the base checkpoint it was trained on (its path and fingerprint are recorded).
      extra: JSON-able run details stored under "extra" (e.g. label key, suffix and prompt lengths).
    """
    dest = Path(path).expanduser().resolve()
    if dest.exists():
        if not overwrite:
            raise FileExistsError(f"adapter directory already exists: {dest} (pass overwrite=True to replace it)")
        shutil.rmtree(dest)
    flat = {k: np.asarray(v) for k, v in openpi_lora.to_openpi(pi05_lora.ModelLora(vlm=adapter, action_expert=None)).items()}
    meta = {
        "format": ADAPTER_FORMAT, "name": name, "prompt": prompt, "expert": "vlm",
        "rank": adapter.attn_rank or adapter.ffn_rank, "alpha": adapter.alpha, "rslora": adapter.rslora,
        "targets": list(adapter.pairs()),
        "base": None if base is None else str(Path(base).expanduser().resolve()),
        "base_fingerprint": None if base is None else base_fingerprint(base),
        "leaves": {k: {"shape": list(v.shape), "dtype": v.dtype.name, "sha256": _sha256(v)} for k, v in flat.items()},
        **({"extra": dict(extra)} if extra else {}),
    }
    dest.mkdir(parents=True)
    ocp.PyTreeCheckpointer().save(dest / "lora", unflatten_dict(flat, sep="/"))  # openpi's nested layout
    (dest / "adapter.json").write_text(json.dumps(meta, indent=1) + "\n")
    return dest


def load_adapter(path: str | os.PathLike, config: ModelConfig, *, base: str | os.PathLike | None = None
                 ) -> tuple[lora.ExpertLora, dict]:
    """Reads a `save_adapter` directory for the model `config` (its VLM expert).

    Args:
      base: the base checkpoint the adapter will run on; when given and the adapter recorded a fingerprint,
        a different base is an error (an adapter trained on other weights produces garbage).
    Returns:
      (adapter with leaves [L, ...] float32, its adapter.json dict).
    Raises:
      FileNotFoundError / ValueError: one line naming the file or field; a shape mismatch lists every leaf.
    """
    src = Path(path).expanduser().resolve()
    meta_file = src / "adapter.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{src} is not an adapter directory (no adapter.json); write one with save_adapter")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:
        raise ValueError(f"{meta_file} is not valid JSON ({e}); the adapter directory is damaged") from e
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{meta_file}: unknown adapter format {meta.get('format')!r} (this code reads {ADAPTER_FORMAT})")
    if base is not None and meta.get("base_fingerprint"):
        got = base_fingerprint(base)
        if got is not None and got != meta["base_fingerprint"]:
            raise ValueError(f"adapter {src} was trained on base {meta.get('base')} but {Path(base).resolve()} holds "
                             "other weights (checksums differ); use the base it was trained on")
    try:
        nested = ocp.PyTreeCheckpointer().restore(src / "lora")
    except Exception as e:  # noqa: BLE001 - orbax raises many types; report one line
        raise ValueError(f"{src / 'lora'}: cannot read the adapter arrays ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    flat = {k: np.asarray(v) for k, v in flatten_dict(nested, sep="/").items()}
    for k, entry in meta.get("leaves", {}).items():
        if k not in flat:
            raise ValueError(f"{src}: leaf {k!r} listed in adapter.json is missing from lora/")
        if _sha256(flat[k]) != entry["sha256"]:
            raise ValueError(f"{src}: leaf {k!r} does not match its SHA-256 in adapter.json; the adapter is damaged")
    model_lora = openpi_lora.from_openpi(flat, config, alpha={"vlm": meta["alpha"]}, rslora=bool(meta.get("rslora", False)))
    if model_lora is None or model_lora.vlm is None:
        raise ValueError(f"{src}: no VLM-expert LoRA leaves found")
    adapter = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), model_lora.vlm)
    pi05_lora.check_adapter(adapter, config)
    return adapter, meta


def load_bank(paths: Sequence[str | os.PathLike], config: ModelConfig, *, base: str | os.PathLike | None = None
              ) -> tuple[lora.LoraBank, tuple[str, ...]]:
    """Stacks saved adapters into a bank for `Engine(..., bank=bank, adapter_names=names)` (ids 1..E in order).

    Raises ValueError listing every mismatched leaf when an adapter does not fit the model or the others.
    """
    adapters, names = [], []
    for p in paths:
        adapter, meta = load_adapter(p, config, base=base)
        adapters.append(adapter)
        names.append(meta["name"])
    return pi05_lora.stack_adapters(adapters, config), tuple(names)
