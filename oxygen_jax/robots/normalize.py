"""Normalisation statistics (openpi's `norm_stats.json`) and the state/action normalisers.

Axes: D the last (feature) dimension of the array being normalised; Ds/Da the robot's native state
and action dims (the length of the stats vectors); Ad = 32 the model's padded dim (`oxygen_jax.axes`).

File format (one file per asset, `assets/<asset_id>/norm_stats.json`):

    {"norm_stats": {"state":   {"mean": [...Ds], "std": [...Ds], "q01": [...Ds], "q99": [...Ds]},
                    "actions": {"mean": [...Da], "std": [...Da], "q01": [...Da], "q99": [...Da]}}}

q01/q99 may be null in old (π0) files; π0.5 needs them.

π0.5 uses quantile normalisation, π0 z-scores:

    quantile_normalize(x)   = (x - q01) / (q99 - q01 + 1e-6) * 2 - 1     stats sliced to x's D, no clipping
    quantile_unnormalize(y) = (y + 1) / 2 * (q99 - q01 + 1e-6) + q01     on y[..., :len(q01)]; the rest passes
    zscore_normalize(x)     = (x - mean) / (std + 1e-6)
    zscore_unnormalize(y)   = y * (std + 1e-6) + mean                    on y[..., :len(mean)]; the rest passes

Example: q01 = [0], q99 = [2] maps x = [0, 1, 2] to ≈ [-1, 0, 1]; a padded y = [[0, 7]] unnormalises to [[1, 7]].

A statistics file is checked before use (`check_statistics`): every value finite and within
±`STATS_MAX_ABS`, std >= 0, q01 <= q99 per dim. q01 == q99 (a dim that never moved) is valid: the
quantile rules stay finite through their + 1e-6 and un-normalise it to q01.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import numpy as np

_EPS = 1e-6
_FIELDS = ("mean", "std", "q01", "q99")
STATS_MAX_ABS = 1e6  # cap on |mean|, std, |q01|, |q99| in a statistics file (robot units: rad, m, mm, gripper)
_MAX_FILE_BYTES = 16 << 20  # a norm_stats.json is a few kB


@dataclasses.dataclass(frozen=True, eq=False)
class NormStats:
    """Per-dimension statistics of one quantity (state or actions), all float64 [D].

    Attributes:
      mean, std: z-score statistics.
      q01, q99: 1% / 99% quantiles (None in old files; required by the quantile normalisers).
    """

    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray | None = None
    q99: np.ndarray | None = None

    def __post_init__(self):
        dim = None
        for name in _FIELDS:
            v = getattr(self, name)
            if v is None and name in ("q01", "q99"):
                continue
            if not isinstance(v, np.ndarray) or v.ndim != 1 or not np.issubdtype(v.dtype, np.floating):
                raise ValueError(
                    f"NormStats.{name} must be a 1-D float numpy array, got {type(v).__name__} "
                    f"{getattr(v, 'shape', '')}; build from lists with NormStats.create(...)"
                )
            if dim is not None and v.shape[0] != dim:
                raise ValueError(f"NormStats.{name} has {v.shape[0]} dims but mean has {dim}")
            dim = v.shape[0] if dim is None else dim

    @classmethod
    def create(cls, mean, std, q01=None, q99=None) -> "NormStats":
        """Builds stats from array-likes (converted to float64)."""
        conv = lambda v: None if v is None else np.asarray(v, np.float64)  # noqa: E731
        return cls(mean=conv(mean), std=conv(std), q01=conv(q01), q99=conv(q99))

    @property
    def dim(self) -> int:
        return self.mean.shape[0]


def check_statistics(where: str, **fields) -> None:
    """Raises a one-line ValueError naming `where`, the field and the dim unless every given vector is finite
    and within ±`STATS_MAX_ABS`, `std` (if given) is >= 0 and q01 <= q99 (if both are given). None is skipped.

    Example: check_statistics("f.json: actions", q01=[0, 1], q99=[2, 1]) passes (a constant dim is fine);
    q01=[0, 3], q99=[2, 1] raises "f.json: actions: q01[1] = 3.0 is above q99[1] = 1.0 ...".
    """
    arrays = {k: np.asarray(v, np.float64).reshape(-1) for k, v in fields.items() if v is not None}
    for name, a in arrays.items():
        bad = ~np.isfinite(a) | (np.abs(np.nan_to_num(a, nan=0.0)) > STATS_MAX_ABS)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{where}: {name}[{i}] = {float(a[i])!r}: statistics must be finite and within ±{STATS_MAX_ABS:g}; "
                             "the file is damaged")
    if "std" in arrays and (arrays["std"] < 0).any():
        i = int(np.argmax(arrays["std"] < 0))
        raise ValueError(f"{where}: std[{i}] = {float(arrays['std'][i])!r} is negative; the file is damaged")
    if "q01" in arrays and "q99" in arrays and arrays["q01"].shape == arrays["q99"].shape:
        above = arrays["q01"] > arrays["q99"]
        if above.any():
            i = int(np.argmax(above))
            raise ValueError(f"{where}: q01[{i}] = {float(arrays['q01'][i])!r} is above q99[{i}] = {float(arrays['q99'][i])!r}; "
                             "quantiles need q01 <= q99 (the file is damaged)")


# -------------------------------------------------------------------------------------------------
# File I/O
# -------------------------------------------------------------------------------------------------


def _resolve(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    return os.path.join(path, "norm_stats.json") if os.path.isdir(path) else path


def load_norm_stats(path: str | os.PathLike) -> dict[str, NormStats]:
    """Reads an openpi `norm_stats.json` (or the one inside directory `path`).

    Returns:
      {"state": NormStats, "actions": NormStats, ...} — every key of the file's "norm_stats" object.
    Raises:
      FileNotFoundError for a missing file (or one that is not a regular file), ValueError naming the file
      and key for malformed content or statistics `check_statistics` refuses (non-finite, beyond
      ±STATS_MAX_ABS, std < 0, q01 > q99).
    """
    path = _resolve(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"norm stats file {path!r} not found (expected openpi's assets/<asset_id>/norm_stats.json)"
        )
    if os.path.getsize(path) > _MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {_MAX_FILE_BYTES} bytes; a norm_stats.json holds a few vectors")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(_MAX_FILE_BYTES + 1).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("norm_stats"), dict):
        raise ValueError(f'{path}: expected a top-level object {{"norm_stats": {{"state": ..., "actions": ...}}}}')
    out = {}
    for key, entry in data["norm_stats"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: norm_stats[{key!r}] must be an object with mean/std/q01/q99")
        for field in ("mean", "std"):
            if entry.get(field) is None:
                raise ValueError(f"{path}: norm_stats[{key!r}] lacks {field!r}")
        try:
            out[key] = NormStats.create(**{f: entry.get(f) for f in _FIELDS})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: norm_stats[{key!r}] is malformed: {e}") from e
        check_statistics(f"{path}: norm_stats[{key!r}]", **{f: getattr(out[key], f) for f in _FIELDS})
    return out


def save_norm_stats(path: str | os.PathLike, stats: Mapping[str, NormStats]) -> None:
    """Writes `stats` in openpi's `norm_stats.json` format (to `path`, or into it if it is a directory)."""
    path = _resolve(path)
    body = {
        key: {f: None if getattr(s, f) is None else getattr(s, f).tolist() for f in _FIELDS} for key, s in stats.items()
    }
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"norm_stats": body}, f, indent=2)


# -------------------------------------------------------------------------------------------------
# Normalisers
# -------------------------------------------------------------------------------------------------


def _float(x) -> tuple[np.ndarray, np.dtype]:
    x = np.asarray(x)
    out_dtype = x.dtype if np.issubdtype(x.dtype, np.floating) else np.dtype(np.float32)
    if x.ndim == 0:
        raise ValueError("expected an array with a feature (last) dimension, got a scalar")
    return x.astype(np.float64), out_dtype


def _quantiles(stats: NormStats) -> tuple[np.ndarray, np.ndarray]:
    if stats.q01 is None or stats.q99 is None:
        raise ValueError(
            "quantile normalisation needs q01 and q99, but these stats have none "
            "(an old π0 norm_stats.json?); recompute the stats or use z-score normalisation"
        )
    return stats.q01, stats.q99


def _check_dim(d: int, stats_dim: int, what: str) -> None:
    if d > stats_dim:
        raise ValueError(f"cannot {what} an array with last dim {d}: the norm stats only have {stats_dim} dims")


def quantile_normalize(x: np.ndarray, stats: NormStats) -> np.ndarray:
    """Maps [q01, q99] to [-1, 1] on x's last dim (stats sliced to it); values outside are not clipped.

    Args:
      x: float [..., D] with D <= stats.dim.
    Returns:
      [..., D], x's float dtype (float32 for integer input).
    """
    x, dtype = _float(x)
    q01, q99 = _quantiles(stats)
    d = x.shape[-1]
    _check_dim(d, q01.shape[0], "quantile-normalise")
    return ((x - q01[:d]) / (q99[:d] - q01[:d] + _EPS) * 2.0 - 1.0).astype(dtype)


def quantile_unnormalize(y: np.ndarray, stats: NormStats) -> np.ndarray:
    """Inverse of `quantile_normalize` on y[..., :len(q01)]; padded dims beyond pass through unchanged.

    Args:
      y: float [..., D] (e.g. D = A = 32 padded model actions).
    Returns:
      [..., D], y's float dtype.
    """
    y, dtype = _float(y)
    q01, q99 = _quantiles(stats)
    n = min(q01.shape[0], y.shape[-1])
    out = y.copy()
    out[..., :n] = (y[..., :n] + 1.0) / 2.0 * (q99[:n] - q01[:n] + _EPS) + q01[:n]
    return out.astype(dtype)


def zscore_normalize(x: np.ndarray, stats: NormStats) -> np.ndarray:
    """(x - mean) / (std + 1e-6) on x's last dim (π0), stats sliced to it."""
    x, dtype = _float(x)
    d = x.shape[-1]
    _check_dim(d, stats.dim, "z-score-normalise")
    return ((x - stats.mean[:d]) / (stats.std[:d] + _EPS)).astype(dtype)


def zscore_unnormalize(y: np.ndarray, stats: NormStats) -> np.ndarray:
    """Inverse of `zscore_normalize` on y[..., :len(mean)]; padded dims pass through (π0)."""
    y, dtype = _float(y)
    n = min(stats.dim, y.shape[-1])
    out = y.copy()
    out[..., :n] = y[..., :n] * (stats.std[:n] + _EPS) + stats.mean[:n]
    return out.astype(dtype)
