"""OxyGen's released language adapter in and out: its `.npz` / `.safetensors` + `adapter_config.json` to our
adapter directory (`adapters.save_adapter`) and back, and serving either kind of folder by name.

Axes (`oxygen_jax.axes`): L layers, N query heads, K KV heads, D VLM width, H head dim, F MLP hidden, r rank.

OxyGen's π0.5 memory adapter is a flat file of openpi's LoRA factors on the VLM (PaliGemma) expert only,
keys "/"-joined, every factor stacked on a leading scanned-layer axis, float32:

    PaliGemma/llm/layers/attn/q_einsum/lora_{a,b}           [L, N, D, r]      [L, N, r, H]
    PaliGemma/llm/layers/attn/kv_einsum/lora_{a,b}          [L, 2, K, D, r]   [L, 2, K, r, H]   (k and v stacked)
    PaliGemma/llm/layers/attn/attn_vec_einsum/lora_{a,b}    [L, N, H, r]      [L, N, r, D]      (head-summed)
    PaliGemma/llm/layers/mlp/gating_einsum_lora_{a,b}       [L, 2, D, r]      [L, 2, r, F]      (gate and up)
    PaliGemma/llm/layers/mlp/linear_lora_{a,b}              [L, F, r]         [L, r, D]

These are exactly the leaves of our adapter directories (`ckpts.openpi_lora` paths, `models.lora` math:
attention scaled by alpha / rank, feed-forward unscaled), so importing is checking, not converting: every
key present and known, every shape equal to the one the base's dimensions give (read from the base, any
size), finite values, one rank that equals `adapter_config.json`'s `rank`, and alpha from that file. The
imported directory records the base's fingerprint like any adapter we train, the prompt (`suffix_seed`),
and OxyGen's file name, key order and `adapter_config.json` text, so `export_oxygen` writes the same bytes
back (`np.savez` is deterministic for equal arrays in equal order).

    python -m oxygen_jax.ckpts.oxygen_adapter import OXYGEN_DIR OUT --base BASE   # -> our adapter directory
    python -m oxygen_jax.ckpts.oxygen_adapter export ADAPTER OUT --base BASE      # -> OxyGen's layout
    python -m oxygen_jax.serve --ckpt BASE --adapter memory=OUT                  # served by name

`load_named_bank` is what `serve --adapter [NAME=]DIR` calls: DIR may be one of our adapter directories or
an OxyGen folder (imported on load, checked against the base's shapes; it records no fingerprint).

An archive is checked before its data is read: a `.npz` member's name must be one of the ten keys and its
`.npy` header (read from the first bytes of the member) must declare a float array whose size the member
holds exactly, `MAX_ADAPTER_BYTES` in all, and, given the base, the shape that base needs; only then is any
array decompressed. A `.safetensors` file is memory-mapped and its keys and shapes are checked the same way
before any value is read. The file's SHA-256 is hashed in chunks. A name that `adapter.json` records for the
exported file must be a plain file name (it is joined to the export folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import numbers
import os
import re
import sys
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from oxygen_jax.ckpts import limits
from oxygen_jax.ckpts.adapters import (
    DEFAULT_ADAPTER_NAME, MAX_ALPHA, MAX_LEAF_ABS, base_fingerprint, load_adapter, save_adapter,
)
from oxygen_jax.ckpts.openpi import read_openpi_config
from oxygen_jax.ckpts.openpi_lora import openpi_paths
from oxygen_jax.ckpts.own import stored_config
from oxygen_jax.ckpts.safetensors import read_safetensors, write_safetensors
from oxygen_jax.models import lora
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
ADAPTER_TYPE = "suffix_lora"  # OxyGen's LoRA on the VLM expert's einsums (not its older bottleneck SuffixAdapter)
FILE_SUFFIXES = (".npz", ".safetensors")
KEYS = tuple(k for t in lora.TARGETS for k in openpi_paths(t, ""))
"""The ten keys of an OxyGen adapter file, (lora_a, lora_b) per target in `lora.TARGETS` order."""
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
MAX_ADAPTER_BYTES = 1 << 30  # all arrays of one adapter file (OxyGen's rank-32 adapter on π0.5: ~60 MB)
_HASH_CHUNK = 1 << 24


class OxygenAdapter(NamedTuple):
    """An OxyGen adapter as read: `arrays` {key: float array} in the file's key order, the parsed config,
    its raw text, and the adapter file."""

    arrays: dict[str, np.ndarray]
    config: dict
    config_text: str
    file: Path


# -------------------------------------------------------------------------------------------------
# Reading and checking
# -------------------------------------------------------------------------------------------------


def is_oxygen_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is an OxyGen adapter folder (holds adapter_config.json) or an adapter file beside one."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() or (p.suffix in FILE_SUFFIXES and (p.parent / CONFIG_FILE).is_file())


def _adapter_file(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(f for f in path.iterdir() if f.suffix in FILE_SUFFIXES and f.is_file())
    if len(found) != 1:
        what = "no .npz or .safetensors file" if not found else f"{len(found)} adapter files ({', '.join(f.name for f in found)})"
        raise ValueError(f"{path}: {what} beside {CONFIG_FILE}; pass the adapter file itself")
    return found[0]


def _npz_headers(file: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{key: (shape, dtype)} of an .npz from its zip directory and each member's .npy header (its first bytes
    only); a member that is not one of `KEYS`, or whose header does not describe exactly its bytes as floats,
    is refused before any data is decompressed."""
    out, total = {}, 0
    with zipfile.ZipFile(file) as z:
        for info in z.infolist():
            key = info.filename.removesuffix(".npy")
            if key not in KEYS or not info.filename.endswith(".npy"):
                raise ValueError(_unknown_key(key))  # by its name: the member is never opened
            if key in out:
                raise ValueError(f"key {key!r} appears twice in the archive")
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
                header = f.tell()
            if dtype.kind != "f" or dtype.hasobject:
                raise ValueError(f"key {key} has dtype {dtype}, expected float32 LoRA factors")
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if all(d >= 0 for d in shape) else -1
            if size != info.file_size - header:
                raise ValueError(f"key {key}: its header declares {shape} {dtype} ({size} bytes) but the member holds "
                                 f"{info.file_size - header}")
            total += size
            if total > MAX_ADAPTER_BYTES:
                raise ValueError(f"the arrays hold more than {MAX_ADAPTER_BYTES} bytes, the cap on an adapter file")
            out[key] = (tuple(int(d) for d in shape), dtype)
    return out


def _read_arrays(file: Path, expected: Mapping[str, tuple[int, ...]] | None, rank: int) -> dict[str, np.ndarray]:
    """The arrays of an adapter file, names (and with `expected`, shapes) checked before any value is read."""
    try:
        if file.suffix == ".safetensors":
            arrays = dict(read_safetensors(file))  # memory-mapped: nothing is read yet
            declared = {k: (tuple(a.shape), a.dtype) for k, a in arrays.items()}
        else:
            declared = _npz_headers(file)
        unknown = next((k for k in declared if k not in KEYS), None)
        if unknown is not None:
            raise ValueError(_unknown_key(unknown))
        for k, (shape, dtype) in declared.items():
            if dtype.kind != "f":
                raise ValueError(f"key {k} has dtype {dtype}, expected float32 LoRA factors")
        for k, want in (expected or {}).items():  # in KEYS order, as check_oxygen reports
            if k in declared and declared[k][0] != tuple(want):
                raise ValueError(_shape_problem(k, declared[k][0], tuple(want), rank))
        if file.suffix == ".safetensors":
            return arrays
        with np.load(file, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except ValueError as e:
        raise ValueError(f"{file}: {str(e).splitlines()[0][:300]}") from None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{file}: not a readable .npz ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def _unknown_key(key: str) -> str:
    hint = " (an action-expert key: OxyGen adapts the VLM expert only)" if "_1/" in key or "_1_" in key else ""
    return f"unknown key {key[:120]!r}{hint}; an OxyGen adapter holds the ten VLM LoRA keys ({KEYS[0]}, ...)"


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _positive(config: Mapping, field: str, where: Path, kind) -> float:
    v = config.get(field)
    ok = isinstance(v, kind) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= MAX_ALPHA
    if not ok:
        raise ValueError(f"{where}: {field} must be a number in (0, {MAX_ALPHA:g}]"
                         f"{' (an integer)' if kind is numbers.Integral else ''}, got {v!r}")
    return v


def read_oxygen(path: str | os.PathLike, *, check_sha256: bool = True, config: ModelConfig | None = None
                ) -> OxygenAdapter:
    """Reads an OxyGen adapter folder (adapter_config.json + one .npz or .safetensors) or the file itself.

    Checks the config's `adapter_type`, `rank`, `alpha`, the file's `sha256` when the config records one
    (`check_sha256`), every key's name and declared size before any value is read (with the base's `config`,
    also its shape), and that every value is a finite float. The rest of the shapes: `check_oxygen`.
    """
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise FileNotFoundError(f"OxyGen adapter path does not exist: {p}")
    cfg_file = (p if p.is_dir() else p.parent) / CONFIG_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} is missing: an OxyGen adapter folder holds {CONFIG_FILE} beside its .npz")
    file = _adapter_file(p)
    text = limits.read_text(cfg_file)
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(settings).__name__}")
    if settings.get("adapter_type", ADAPTER_TYPE) != ADAPTER_TYPE:
        raise ValueError(f"{cfg_file}: adapter_type {settings['adapter_type']!r:.60} is not {ADAPTER_TYPE!r} (OxyGen's LoRA on "
                         "the VLM einsums, the only kind this imports)")
    rank = _positive(settings, "rank", cfg_file, numbers.Integral)
    _positive(settings, "alpha", cfg_file, numbers.Real)
    recorded = settings.get("sha256")
    if check_sha256 and isinstance(recorded, str) and re.fullmatch(r"[0-9a-f]{64}", recorded):
        if _sha256(file) != recorded:
            raise ValueError(f"{file}: SHA-256 differs from the sha256 in {cfg_file}; the file is damaged or not the "
                             "one the config describes (--ignore-sha256 imports it anyway)")
    arrays = _read_arrays(file, expected_shapes(config, int(rank)) if config is not None else None, int(rank))
    limits.check_finite(arrays, str(file), max_abs=MAX_LEAF_ABS)
    return OxygenAdapter(arrays=arrays, config=settings, config_text=text, file=file)


def expected_shapes(config: ModelConfig, rank: int) -> dict[str, tuple[int, ...]]:
    """{key: shape} of an OxyGen adapter of `rank` on the VLM expert of `config` (every dim read from it)."""
    dims = pi05_lora.expert_dims(config.vlm)
    out = {}
    for t in lora.TARGETS:
        a, b = lora.target_shapes(dims, t, rank)
        ka, kb = openpi_paths(t, "")
        out[ka], out[kb] = (dims.depth, *a), (dims.depth, *b)
    return out


def check_oxygen(ox: OxygenAdapter, config: ModelConfig) -> None:
    """One-line ValueError naming the first key that is unknown, missing or mis-shaped for the base `config`,
    or whose rank differs from adapter_config.json's."""
    rank = int(ox.config["rank"])
    for k in ox.arrays:
        if k not in KEYS:
            raise ValueError(f"{ox.file}: {_unknown_key(k)}")
    for k in KEYS:
        if k not in ox.arrays:
            raise ValueError(f"{ox.file}: key {k!r} is missing (an OxyGen adapter holds all ten VLM LoRA keys)")
    for k, want in expected_shapes(config, rank).items():
        if tuple(ox.arrays[k].shape) != want:
            raise ValueError(f"{ox.file}: {_shape_problem(k, tuple(ox.arrays[k].shape), want, rank)}")


def _shape_problem(key: str, got: tuple[int, ...], want: tuple[int, ...], rank: int) -> str:
    """Why `key` of shape `got` does not fit a base that needs `want` at `rank`, in words."""
    a_rank = got[-1 if key.endswith("a") else -2] if len(got) >= 2 else None
    hint = (f"its rank {a_rank} differs from rank {rank} in {CONFIG_FILE}" if a_rank != rank
            else "the adapter was trained on a base of other dimensions")
    return f"key {key!r} has shape {got}, expected {want} for this base at rank {rank}; {hint}"


def to_expert_lora(ox: OxygenAdapter, config: ModelConfig) -> lora.ExpertLora:
    """The checked adapter (`check_oxygen`) as our `ExpertLora`, float32, alpha from adapter_config.json."""
    check_oxygen(ox, config)
    pairs = {}
    for t in lora.TARGETS:
        ka, kb = openpi_paths(t, "")
        pairs[t] = lora.LoraPair(a=np.asarray(ox.arrays[ka], np.float32), b=np.asarray(ox.arrays[kb], np.float32))
    return lora.ExpertLora(**pairs, alpha=float(ox.config["alpha"]), rslora=False)


def adapter_meta(ox: OxygenAdapter, name: str = DEFAULT_ADAPTER_NAME) -> dict:
    """The adapter.json fields OxyGen's config gives: name, prompt (`suffix_seed`) and `extra` (label_key from
    `language_target`, suffix_len, steps, and what `export_oxygen` needs to write the same bytes back)."""
    c = ox.config
    extra = {"oxygen": {"file": ox.file.name, "keys": list(ox.arrays), "config_text": ox.config_text}}
    if isinstance(c.get("language_target"), str):
        extra["label_key"] = c["language_target"].removeprefix("language.")
    if isinstance(c.get("suffix_length"), int):
        extra["suffix_len"] = c["suffix_length"] + 1  # OxyGen's max_len counts model inputs; T adds the last target
    if isinstance(c.get("training_step"), int):
        extra["steps"] = c["training_step"]
    prompt = c["suffix_seed"] if isinstance(c.get("suffix_seed"), str) else "Memory: "
    return {"name": name, "prompt": prompt, "extra": extra}


# -------------------------------------------------------------------------------------------------
# Import, export
# -------------------------------------------------------------------------------------------------


def base_config(base: str | os.PathLike) -> ModelConfig:
    """The π0.5 config of a base checkpoint (ours or openpi's) from its metadata, no weights read."""
    p = Path(base).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"base checkpoint {p.resolve()} is not a directory")
    return stored_config(p) or read_openpi_config(p)


def import_oxygen(src: str | os.PathLike, dest: str | os.PathLike, *, base: str | os.PathLike,
                  name: str = DEFAULT_ADAPTER_NAME, config: ModelConfig | None = None, check_sha256: bool = True,
                  overwrite: bool = False) -> Path:
    """Writes OxyGen's adapter at `src` as our adapter directory `dest` for the base checkpoint `base`.

    Args:
      src: an OxyGen folder (adapter_config.json + one .npz / .safetensors) or the adapter file.
      base: the base it will run on (ours or an openpi checkpoint; `config` defaults to its dims), whose
        fingerprint the adapter records (`adapters.base_fingerprint`).
      name: the name `serve` gives it.
    Returns:
      `dest`, resolved. Raises ValueError / FileNotFoundError in one line (the key, field or file).
    """
    config = config or base_config(base)
    ox = read_oxygen(src, check_sha256=check_sha256, config=config)
    adapter = to_expert_lora(ox, config)
    meta = adapter_meta(ox, name)
    return save_adapter(dest, adapter, prompt=meta["prompt"], name=name, base=base, extra=meta["extra"],
                        overwrite=overwrite)


def export_oxygen(src: str | os.PathLike, dest: str | os.PathLike, *, base: str | os.PathLike,
                  config: ModelConfig | None = None, fmt: str | None = None) -> Path:
    """Writes our adapter directory `src` (served on `base`) in OxyGen's layout into the folder `dest`.

    An adapter imported by `import_oxygen` comes back byte for byte (its file name, key order and config text
    were recorded); any other gets `adapter.npz` (keys sorted) and an adapter_config.json made from its
    adapter.json (rank, alpha, suffix_seed = prompt, base_checkpoint, sha256 of the file).
    Args:
      fmt: "npz" or "safetensors" (default: what was imported, else npz).
    Returns: the written adapter file.
    """
    adapter, meta = load_adapter(src, config or base_config(base), base=base)
    if adapter.attn_rank != adapter.ffn_rank or set(adapter.pairs()) != set(lora.TARGETS):
        raise ValueError(f"{src}: OxyGen's layout needs all five targets at one rank; this adapter has "
                         f"{sorted(adapter.pairs())} at ranks {adapter.attn_rank}/{adapter.ffn_rank}")
    extra = meta.get("extra") if isinstance(meta.get("extra"), dict) else {}
    ox = extra.get("oxygen") if isinstance(extra.get("oxygen"), dict) else {}
    flat = {}
    for t, pair in adapter.pairs().items():
        ka, kb = openpi_paths(t, "")
        flat[ka], flat[kb] = np.asarray(pair.a, np.float32), np.asarray(pair.b, np.float32)
    keys = ox.get("keys")
    order = keys if isinstance(keys, list) and sorted(map(str, keys)) == sorted(flat) else sorted(flat)
    fmt = fmt or (Path(str(ox["file"])).suffix.lstrip(".") if "file" in ox else "npz")
    if fmt not in ("npz", "safetensors"):
        raise ValueError(f"format must be 'npz' or 'safetensors', got {fmt!r}")
    recorded_name = ox.get("file")
    if recorded_name is not None and not (isinstance(recorded_name, str) and _NAME.fullmatch(recorded_name)
                                          and recorded_name not in (".", "..")):
        raise ValueError(f"{src}: adapter.json records the file name {str(recorded_name)[:80]!r}, not a plain file "
                         "name; the adapter directory is damaged")
    name = recorded_name if recorded_name and recorded_name.endswith("." + fmt) else f"adapter.{fmt}"
    out = Path(dest).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    file = out / name
    partial = out / f".{name}.partial"  # written aside, then renamed: a reader never sees half a file
    if fmt == "npz":
        with open(partial, "wb") as f:
            np.savez(f, **{k: flat[k] for k in order})
    else:
        write_safetensors(partial, flat)
    os.replace(partial, file)
    text = ox.get("config_text")
    recorded = json.loads(text) if isinstance(text, str) else None
    verbatim = (recorded is not None and name == ox.get("file")  # only beside the very file it describes, and
                and (recorded.get("rank"), recorded.get("alpha")) == (adapter.attn_rank, adapter.alpha))  # still true
    if not verbatim:
        config_json = {**recorded, "rank": adapter.attn_rank, "alpha": adapter.alpha} if recorded is not None else {
            "adapter_type": ADAPTER_TYPE, "alpha": adapter.alpha, "rank": adapter.attn_rank,
            "base_checkpoint": meta.get("base"), "language_target": extra.get("label_key"),
            "suffix_seed": meta.get("prompt"),
            **({"suffix_length": extra["suffix_len"] - 1} if isinstance(extra.get("suffix_len"), int) else {}),
            **({"training_step": extra["steps"]} if isinstance(extra.get("steps"), int) else {})}
        config_json["sha256"] = _sha256(file)
        text = json.dumps(config_json, indent=2) + "\n"
    (out / f".{CONFIG_FILE}.partial").write_text(text)
    os.replace(out / f".{CONFIG_FILE}.partial", out / CONFIG_FILE)
    return file


# -------------------------------------------------------------------------------------------------
# Serving by name
# -------------------------------------------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str | None, Path]:
    """`serve --adapter` values: "NAME=DIR" (served as NAME) or "DIR" (the name its files give)."""
    name, sep, path = spec.partition("=")
    if sep and _NAME.fullmatch(name) and path:
        return name, Path(path)
    return None, Path(spec)


def load_any(path: str | os.PathLike, config: ModelConfig, *, base: str | os.PathLike | None,
             name: str | None = None) -> tuple[lora.ExpertLora, dict]:
    """(adapter, its adapter.json fields) from one of our adapter directories (fingerprint-checked against
    `base`) or an OxyGen folder (imported on load: keys and shapes checked against `config`; default name
    "memory"). `name` replaces the stored name."""
    p = Path(path).expanduser()
    if (p / "adapter.json").is_file() or not is_oxygen_dir(p):
        adapter, meta = load_adapter(p, config, base=base)
    else:
        ox = read_oxygen(p, config=config)
        adapter, meta = to_expert_lora(ox, config), adapter_meta(ox)
    return adapter, {**meta, "name": name or meta["name"]}


def load_named_bank(specs: Sequence[str], config: ModelConfig, *, base: str | os.PathLike | None
                    ) -> tuple[lora.LoraBank, tuple[str, ...]]:
    """A bank for `Engine(..., bank=, adapter_names=)` from `serve --adapter` values (`parse_spec`), ids 1..E."""
    adapters, names = [], []
    for spec in specs:
        name, path = parse_spec(spec)
        adapter, meta = load_any(path, config, base=base, name=name)
        adapters.append(adapter)
        names.append(meta["name"])
    if len(set(names)) != len(names):
        raise ValueError(f"--adapter: two adapters share a name ({names}); name them with NAME=DIR")
    return pi05_lora.stack_adapters(adapters, config), tuple(names)


# -------------------------------------------------------------------------------------------------
# Command line
# -------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m oxygen_jax.ckpts.oxygen_adapter",
                description="Convert OxyGen's released π0.5 language adapter (adapter_config.json + .npz or "
                            ".safetensors, openpi's LoRA keys on the VLM expert) to an oxygen_jax adapter directory "
                            "and back. Both directions check every key and shape against the base checkpoint.")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="OxyGen folder (or its .npz / .safetensors) -> our adapter directory")
    imp.add_argument("src", type=Path, help="OxyGen adapter folder (adapter_config.json + adapter file) or the file")
    imp.add_argument("out", type=Path, help="new adapter directory (serve --adapter NAME=OUT)")
    imp.add_argument("--name", default=DEFAULT_ADAPTER_NAME, help="the name it is served by")
    imp.add_argument("--ignore-sha256", action="store_true",
                     help="import even when the file's SHA-256 differs from adapter_config.json's sha256")
    imp.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    exp = sub.add_parser("export", help="our adapter directory -> OxyGen's layout (adapter_config.json + file)")
    exp.add_argument("src", type=Path, help="adapter directory (training.memory output or an import)")
    exp.add_argument("out", type=Path, help="folder to write adapter_config.json and the adapter file into")
    exp.add_argument("--format", choices=("npz", "safetensors"), default=None,
                     help="adapter file format (default: the imported one, else npz)")
    for sp in (imp, exp):
        sp.add_argument("--base", type=Path, required=True,
                        help="the base checkpoint it runs on: ours or an openpi π0.5 checkpoint (e.g. pi05_libero); "
                             "its dims check every shape and its fingerprint ties the adapter to it")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); one line on stderr and exit status 2 for bad input."""
    args = _parser().parse_args(argv)
    try:
        if base_fingerprint(args.base) is None:
            raise ValueError(f"--base {args.base}: not a π0.5 checkpoint (ours or openpi's)")
        if args.command == "import":
            dest = import_oxygen(args.src, args.out, base=args.base, name=args.name,
                                 check_sha256=not args.ignore_sha256, overwrite=args.overwrite)
        else:
            dest = export_oxygen(args.src, args.out, base=args.base, fmt=args.format)
    except (OSError, ValueError) as e:
        print(f"python -m oxygen_jax.ckpts.oxygen_adapter {args.command}: error: {str(e).splitlines()[0]}",
              file=sys.stderr)
        return 2
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
