"""Language-adapter files: one trained VLM-expert LoRA per directory, checksummed and tied to its base.

Layout of a `save_adapter` directory:

    lora/          orbax PyTree item, openpi's nested LoRA paths, e.g. PaliGemma/llm/layers/attn/q_einsum/lora_a
    adapter.json   format, name, request prompt, rank, alpha, rslora, targets, expert ("vlm"), the base
                   checkpoint's path and fingerprint (a quantized base's also its float source's:
                   `base_source_fingerprint`, `base_quantization`), each leaf's shape / dtype / SHA-256, optional `extra`

Axes (`oxygen_jax.axes`): L layers (every adapter leaf is stacked [L, ...]), E stored adapters of a bank
(ids 1..E; id 0 = base weights).

`load_bank` gives what an engine needs: `Engine(params, cfg, tok, bank=bank, adapter_names=names)`. The base
fingerprint (`base_fingerprint`, a hash of an `own.save_params` directory's checksums) lets a load
refuse a base the adapter was not trained on.

A load checks the files before the arrays become weights, each failure one line naming the file and the
field: adapter.json's `base_fingerprint` is required and must equal the base's (an adapter is only ever
served on the base it was trained on; the one exception, said in one warning line: a quantized base and the
float checkpoint it was made from count as one base, either way round); `alpha` is a finite number in (0, `MAX_ALPHA`]; `leaves` lists
exactly the leaves in lora/, each matching its SHA-256; every leaf is finite with |x| <= `MAX_LEAF_ABS`.

A save never leaves a moment without an adapter at `path`: it writes a hidden folder beside it and swaps it in
(`replace_dir`: one atomic exchange on Linux), so a process killed mid-save leaves the previous adapter or
the new one, whole.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import numbers
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax.traverse_util import flatten_dict, unflatten_dict

from oxygen_jax.ckpts import lerobot, limits, openpi_lora
from oxygen_jax.ckpts.orbax_io import resolve_params_item
from oxygen_jax.ckpts.own import quantization_info
from oxygen_jax.models import lora
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.config import ModelConfig

ADAPTER_FORMAT = 1
DEFAULT_ADAPTER_NAME = "memory"  # the textual-memory adapter (the one the embedded demo serves)
MAX_ALPHA = 4096.0  # LoRA alpha cap (trained adapters use alpha = rank .. 2 rank, ranks <= 256)
MAX_LEAF_ABS = 1e4  # |A|, |B| cap (trained LoRA factors are O(1); 1e4 already scales a layer by 1e8 r)
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


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


_SMALL_FILE = 1 << 20  # item files hashed whole (tree metadata, manifests); larger ones by name and size


def _item_fingerprint(item: Path) -> str:
    """SHA-256 over an orbax item's files: relative path and size of each, and the bytes of those up to 1 MiB.

    Cheap at any model size: the arrays' bytes are not read. An OCDBT data file's name is unique to the save
    that wrote it, so a copy of the checkpoint has the same fingerprint and another save has another.
    """
    h = hashlib.sha256()
    for f in sorted(p for p in item.rglob("*") if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.relative_to(item).as_posix()}\0{size}\0".encode())
        if size <= _SMALL_FILE:
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def base_fingerprint(base_dir: str | os.PathLike) -> str | None:
    """What identifies a base checkpoint's weights, or None when `base_dir` is no π checkpoint.

    An `own.save_params` directory: the SHA-256 of its checksums item (a hash of every array). An openpi
    checkpoint (its root, a step directory or its `params` item, all alike): `_item_fingerprint` of the item. A
    LeRobot policy folder (or its parent): the SHA-256 of its `model.safetensors`, read in chunks.
    """
    path = Path(base_dir) / "checksums" / "metadata"
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    if (Path(base_dir) / "config").is_dir():
        return None  # ours without checksums: damaged
    if lerobot.is_lerobot_dir(base_dir):
        weights = lerobot.policy_dir(base_dir) / lerobot.WEIGHTS
        if not weights.is_file():
            return None
        h = hashlib.sha256()
        with open(weights, "rb") as f:
            for chunk in iter(lambda: f.read(16 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    try:
        return _item_fingerprint(resolve_params_item(base_dir))
    except (OSError, ValueError):
        return None


def save_adapter(
    path: str | os.PathLike,
    adapter: lora.ExpertLora,
    *,
    prompt: str,
    name: str = DEFAULT_ADAPTER_NAME,
    base: str | os.PathLike,
    extra: Mapping | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes one VLM-expert adapter (leaves [L, ...]) to the new directory `path` (layout: module docstring).

    Args:
      prompt: the request prompt the adapter was trained to answer (e.g. "Memory: ").
      base: the base checkpoint it was trained on, an `own.save_params` directory (its path and fingerprint
        are recorded; `load_adapter` serves the adapter on that base only).
      extra: JSON-able run details stored under "extra" (e.g. label key, suffix and prompt lengths).
    """
    fingerprint = base_fingerprint(base)
    if fingerprint is None:
        raise ValueError(f"base {Path(base).resolve()} is not a π checkpoint (ours, openpi's or LeRobot's): an adapter "
                         "records the fingerprint of the base it was trained on")
    dest = Path(path).expanduser().resolve()
    if dest.exists() and not overwrite:
        raise FileExistsError(f"adapter directory already exists: {dest} (pass overwrite=True to replace it)")
    flat = {k: np.asarray(v) for k, v in openpi_lora.to_openpi(pi05_lora.ModelLora(vlm=adapter, action_expert=None)).items()}
    meta = {
        "format": ADAPTER_FORMAT, "name": name, "prompt": prompt, "expert": "vlm",
        "rank": adapter.attn_rank or adapter.ffn_rank, "alpha": adapter.alpha, "rslora": adapter.rslora,
        "targets": list(adapter.pairs()),
        "base": str(Path(base).expanduser().resolve()), "base_fingerprint": fingerprint,
        **_source_of(base),
        "leaves": {k: {"shape": list(v.shape), "dtype": v.dtype.name, "sha256": _sha256(v)} for k, v in flat.items()},
        **({"extra": dict(extra)} if extra else {}),
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    aside = _beside(dest, "new")  # the new adapter is written whole first
    try:
        # This process alone (in a multi-process run the others never reach orbax's barriers).
        only_me = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                                     active_processes={jax.process_index()})
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=only_me),
                         multiprocessing_options=only_me).save(aside / "lora", unflatten_dict(flat, sep="/"))
        (aside / "adapter.json").write_text(json.dumps(meta, indent=1) + "\n")
        replace_dir(aside, dest)
    finally:
        shutil.rmtree(aside, ignore_errors=True)  # left only when something failed before the swap
    return dest


def _source_of(base: str | os.PathLike) -> dict:
    """For a quantized base, the float checkpoint it was made from (adapter.json's `base_source_fingerprint`, so
    the adapter also loads on that float base) and its weights ("int8" / "fp8"); {} for a float base."""
    info = _quantization(base)
    source = _provenance(info or {}).get("source_fingerprint")
    if not isinstance(source, str) or not _FINGERPRINT.fullmatch(source):
        return {}
    return {"base_source_fingerprint": source, "base_quantization": info.get("weights")}


def replace_dir(new: Path, dest: Path) -> None:
    """Puts the folder `new` in place of `dest` (absent or a folder): an atomic exchange where the kernel has one
    (Linux renameat2), else two renames. Either way a reader sees the old folder or the new one, never a mix;
    a kill between the two fallback renames leaves the old one beside `dest` as `.<name>.old-*`."""
    if not dest.exists():
        os.rename(new, dest)
        return
    if _exchange(new, dest):
        shutil.rmtree(new, ignore_errors=True)  # now the old folder
        return
    old = _beside(dest, "old")
    os.rename(dest, old / dest.name)
    try:
        os.rename(new, dest)
    except OSError:
        os.rename(old / dest.name, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _beside(dest: Path, what: str) -> Path:
    """A new hidden folder next to `dest` (same file system, so renames stay renames; the usual permissions)."""
    folder = dest.parent / f".{dest.name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    return folder


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically with renameat2(RENAME_EXCHANGE); False where the C library or the file system
    has no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _check_meta(meta, meta_file: Path, base: str | os.PathLike | None) -> None:
    """adapter.json's fields before any array is read (module docstring); one line naming the file and field."""
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_file}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{meta_file}: unknown adapter format {meta.get('format')!r} (this code reads {ADAPTER_FORMAT})")
    alpha = meta.get("alpha")
    if (not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or not math.isfinite(alpha)
            or not 0 < alpha <= MAX_ALPHA):
        raise ValueError(f"{meta_file}: alpha must be a finite number in (0, {MAX_ALPHA:g}], got {alpha!r}; "
                         "the adapter.json is damaged")
    if not isinstance(meta.get("rslora", False), bool):
        raise ValueError(f"{meta_file}: rslora must be true or false, got {meta['rslora']!r}")
    if not isinstance(meta.get("name"), str) or not meta["name"]:
        raise ValueError(f"{meta_file}: name must be a non-empty string, got {meta.get('name')!r}")
    leaves = meta.get("leaves")
    if not isinstance(leaves, dict) or not all(isinstance(e, dict) and isinstance(e.get("sha256"), str)
                                               for e in leaves.values()):
        raise ValueError(f"{meta_file}: leaves must map every leaf path to its shape, dtype and sha256")
    recorded = meta.get("base_fingerprint")
    if not isinstance(recorded, str) or not _FINGERPRINT.fullmatch(recorded):
        raise ValueError(f"{meta_file}: base_fingerprint is {'missing' if recorded is None else repr(recorded)}; an "
                         "adapter is served only on the base it was trained on (save_adapter(..., base=BASE) records it)")
    if base is None:
        raise ValueError(f"{meta_file}: pass the base checkpoint the adapter will run on (base=, serve --ckpt) so its "
                         "base_fingerprint can be checked")
    got = base_fingerprint(base)
    if got is None:
        raise ValueError(f"{Path(base).resolve()} is not a π checkpoint (ours, openpi's or LeRobot's), so the adapter's "
                         f"base_fingerprint in {meta_file} cannot be checked; serve it on the base it was trained on")
    if got == recorded:
        return
    relation = _quantized_relation(meta, base, got)
    if relation is None:
        raise ValueError(f"adapter {meta_file.parent} was trained on base {meta.get('base')} but {Path(base).resolve()} "
                         "holds other weights (checksums differ); use the base it was trained on")
    warnings.warn(f"adapter {meta_file.parent}: {relation}", stacklevel=3)


def _quantized_relation(meta: Mapping, base: str | os.PathLike, got: str) -> str | None:
    """Why `base` counts as the adapter's base although its fingerprint differs, or None when it does not.

    Only two cases: `base` is a quantization (`python -m oxygen_jax.quantize`) of the float checkpoint the
    adapter was trained on (its `quantization/` provenance records that checkpoint's fingerprint), or the
    adapter was trained on a quantization of `base` (adapter.json's `base_source_fingerprint`). Two
    quantizations of one source are not the same base: each one's rounding is what the adapter learnt on.
    `got`: `base`'s own fingerprint (already computed: for a LeRobot base it hashes gigabytes).
    """
    recorded = meta["base_fingerprint"]
    info = _quantization(base)
    if info is not None and _provenance(info).get("source_fingerprint") == recorded:
        return (f"trained on the float base {meta.get('base')}, loaded on its {info.get('weights')} quantization "
                f"{Path(base).resolve()} (the same weights, rounded)")
    source = meta.get("base_source_fingerprint")
    if isinstance(source, str) and _FINGERPRINT.fullmatch(source) and source == got:
        return (f"trained on the {meta.get('base_quantization', 'quantized')} base {meta.get('base')}, loaded on the "
                f"float base it was quantized from, {Path(base).resolve()}")
    return None


def _provenance(info: Mapping) -> Mapping:
    """The `quantization/` item's provenance map ({} where a damaged file holds something else)."""
    prov = info.get("provenance")
    return prov if isinstance(prov, Mapping) else {}


def _quantization(base: str | os.PathLike) -> dict | None:
    """The `quantization/` item of our checkpoint at `base` (`own.quantization_info`), None for any other."""
    try:
        info = quantization_info(base)
    except (OSError, ValueError):  # a directory that is no checkpoint of ours
        return None
    return info if isinstance(info, Mapping) else None


def load_adapter(path: str | os.PathLike, config: ModelConfig, *, base: str | os.PathLike | None = None
                 ) -> tuple[lora.ExpertLora, dict]:
    """Reads a `save_adapter` directory for the model `config` (its VLM expert), checked first (module docstring).

    Args:
      base: the base checkpoint the adapter will run on (an `own.save_params` directory); required: its
        fingerprint must equal the one adapter.json records (an adapter trained on other weights produces
        garbage).
    Returns:
      (adapter with leaves [L, ...] float32, its adapter.json dict).
    Raises:
      FileNotFoundError / ValueError: one line naming the file or field; a shape mismatch lists every leaf.
    """
    src = Path(path).expanduser().resolve()
    meta_file = src / "adapter.json"
    if not meta_file.exists():
        raise FileNotFoundError(f"{src} is not an adapter directory (no adapter.json); write one with save_adapter")
    try:
        meta = limits.read_json(meta_file)
    except ValueError as e:
        raise ValueError(f"{str(e).splitlines()[0]}; the adapter directory is damaged") from e
    _check_meta(meta, meta_file, base)
    try:
        nested = ocp.PyTreeCheckpointer().restore(src / "lora")
    except Exception as e:  # noqa: BLE001 - orbax raises many types; report one line
        raise ValueError(f"{src / 'lora'}: cannot read the adapter arrays ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    flat = {k: np.asarray(v) for k, v in flatten_dict(nested, sep="/").items()}
    unlisted = sorted(set(flat) - set(meta["leaves"]))
    if unlisted:
        raise ValueError(f"{src}: leaf {unlisted[0]!r} in lora/ is not listed (with its SHA-256) in adapter.json; "
                         "the adapter is damaged")
    for k, entry in meta["leaves"].items():
        if k not in flat:
            raise ValueError(f"{src}: leaf {k!r} listed in adapter.json is missing from lora/")
        if _sha256(flat[k]) != entry["sha256"]:
            raise ValueError(f"{src}: leaf {k!r} does not match its SHA-256 in adapter.json; the adapter is damaged")
    limits.check_finite(flat, str(src / "lora"), max_abs=MAX_LEAF_ABS)
    model_lora = openpi_lora.from_openpi(flat, config, alpha={"vlm": float(meta["alpha"])},
                                         rslora=meta.get("rslora", False))
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
