"""Parameter manifests: a JSON list of openpi leaf shapes compared with the tree a config implies.

`check_manifest` allocates nothing: the expected shapes come from `params.openpi_shapes` (and,
for the preset comparison, `jax.eval_shape` of the parameter init); LoRA leaves are checked
against the shapes their expert and rank imply.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

from oxygen_jax.ckpts.openpi import infer_model_config
from oxygen_jax.ckpts.orbax_io import PathLike
from oxygen_jax.ckpts import openpi_lora
from oxygen_jax.models.pi05.config import ModelConfig, model_config
from oxygen_jax.models.pi05.params import abstract_params, openpi_shapes, to_openpi_dict


@dataclasses.dataclass(frozen=True)
class ManifestRow:
    """One leaf of a manifest comparison. `expected`/`got` is None where the leaf is absent."""

    path: str
    expected: tuple[int, ...] | None
    got: tuple[int, ...] | None
    ok: bool
    note: str = ""  # "missing", "unexpected", "mis-shaped", "LoRA leaf", "mis-shaped LoRA leaf", "unknown LoRA leaf"


@dataclasses.dataclass(frozen=True)
class ManifestCheck:
    """Result of `check_manifest`.

    Attributes:
      config: the config the manifest was compared with (given or inferred).
      rows: one row per leaf in the manifest or the expected tree (our table order, then extras).
      preset: name of the preset also compared with (None if skipped).
      preset_rows: the rows that differ from the preset's abstract tree (empty = exact match).
    """

    config: ModelConfig
    rows: tuple[ManifestRow, ...]
    preset: str | None = None
    preset_rows: tuple[ManifestRow, ...] = ()

    def _with(self, note: str) -> list[ManifestRow]:
        return [r for r in self.rows if r.note == note]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def matches_preset(self) -> bool:
        return self.preset is not None and not self.preset_rows

    @property
    def missing(self) -> list[ManifestRow]:
        return self._with("missing")

    @property
    def unexpected(self) -> list[ManifestRow]:
        return self._with("unexpected")

    @property
    def misshaped(self) -> list[ManifestRow]:
        return self._with("mis-shaped")

    @property
    def lora(self) -> list[ManifestRow]:
        """Every LoRA row (fitting or not)."""
        return [r for r in self.rows if "LoRA" in r.note]

    def summary(self) -> str:
        lines = [f"{sum(r.ok for r in self.rows)}/{len(self.rows)} leaves ok"]
        if self.lora:
            lines[0] += f" ({len(self.lora)} LoRA leaves)"
        lines += [f"  {r.note}: {r.path} expected {r.expected} got {r.got}" for r in self.rows if not r.ok]
        if self.preset is not None:
            lines.append(f"preset {self.preset!r}: {'exact match' if self.matches_preset else 'differs'}")
            lines += [f"  {r.note}: {r.path} preset {r.expected} got {r.got}" for r in self.preset_rows]
        return "\n".join(lines)


def _compare(
    got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], config: ModelConfig
) -> list[ManifestRow]:
    rows = []
    for k, exp in expected.items():
        g = got.get(k)
        if g is None:
            rows.append(ManifestRow(k, exp, None, False, "missing"))
        else:
            rows.append(ManifestRow(k, exp, g, g == exp, "" if g == exp else "mis-shaped"))
    lora_expected = openpi_lora.expected_openpi_shapes(got, config)  # ranks inferred from the manifest
    for k in sorted(set(got) - set(expected)):
        if k not in lora_expected:
            rows.append(ManifestRow(k, None, got[k], False, "unexpected"))
        elif lora_expected[k] is None:
            rows.append(ManifestRow(k, None, got[k], False, "unknown LoRA leaf"))
        else:
            ok = got[k] == lora_expected[k]
            rows.append(ManifestRow(k, lora_expected[k], got[k], ok, "LoRA leaf" if ok else "mis-shaped LoRA leaf"))
    return rows


def check_manifest(
    manifest_path: PathLike,
    config: ModelConfig | None = None,
    *,
    preset: str | None = "pi05",
) -> ManifestCheck:
    """Compares a parameter manifest with the π0.5 tree, allocating nothing.

    The manifest is JSON with `"leaves": {openpi path: {"shape": [...], "dtype": ...}}` (the format
    of the shared `pi05_param_manifest.json` and `pi05_lora_param_manifest.json`). LoRA leaves are
    checked against the shapes their expert and rank imply (ranks read off the `lora_a` leaves).

    Args:
      manifest_path: the manifest file.
      config: compared with `openpi_shapes(config)`; default: inferred from the manifest.
      preset: also compare with this preset's abstract tree (`jax.eval_shape` of the parameter
        init, flattened with `to_openpi_dict`); None skips it.

    Returns:
      A `ManifestCheck`; `.ok` is True when every leaf matches.
    """
    with open(Path(manifest_path).expanduser()) as f:
        manifest = json.load(f)
    if "leaves" not in manifest:
        raise ValueError(f"{manifest_path}: not a parameter manifest (no 'leaves' entry)")
    got = {k: tuple(int(d) for d in v["shape"]) for k, v in manifest["leaves"].items()}
    if config is None:
        config = infer_model_config(got)
    rows = _compare(got, openpi_shapes(config), config)
    preset_rows: list[ManifestRow] = []
    if preset is not None:
        preset_config = model_config(preset)
        tree = to_openpi_dict(abstract_params(preset_config))  # eval_shape: no allocation
        preset_shapes = {k: tuple(v.shape) for k, v in tree.items()}
        preset_rows = [r for r in _compare(got, preset_shapes, preset_config) if not r.ok]
    return ManifestCheck(config=config, rows=tuple(rows), preset=preset, preset_rows=tuple(preset_rows))
