"""Dataset statistics: `meta/stats.json` (v3.0, v2.0), or for v2.1 the per-episode `meta/episodes_stats.jsonl`
aggregated as LeRobot does on load.

`read_stats(meta)` returns {feature: {stat: float64 array}} with the stats the file holds (`min`, `max`,
`mean`, `std`, `count`, and in v3.0 also `q01` ... `q99`); vectors per dimension, camera features per channel
([3, 1, 1], on the [0, 1] scale). Aggregation (v2.1) over episodes e with counts c_e:

    mean = sum c_e mean_e / sum c_e
    std  = sqrt(sum c_e (std_e^2 + (mean_e - mean)^2) / sum c_e)
    min, max = elementwise min / max;  count = sum c_e

(quantiles cannot be aggregated and are absent). `norm_stats(stats, key)` turns one feature into the
project's `NormStats` (mean, std, q01, q99). A NaN or infinite statistic, or a negative count, is a one-line
ValueError naming the file, feature and statistic: normalising with it would turn every input into NaN.
"""

from __future__ import annotations

import numpy as np

from oxygen_jax.robots.normalize import NormStats
from training.data.lerobot.meta import DatasetMeta, read_json, read_jsonl


def _arrays(stats: dict, where: str) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for feature, per in stats.items():
        if not isinstance(per, dict):
            raise ValueError(f"{where}: field {feature!r} must map stat names to arrays")
        try:
            out[feature] = {k: np.asarray(v, np.float64) for k, v in per.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{where}: field {feature!r} holds a non-numeric stat") from None
        for k, v in out[feature].items():
            if not np.isfinite(v).all():
                raise ValueError(f"{where}: {feature}.{k} holds {v.reshape(-1)[~np.isfinite(v.reshape(-1))][0]}; "
                                 "statistics must be finite (recompute them, e.g. with LeRobot's compute_stats)")
            if k in ("count", "std") and (v < 0).any():
                raise ValueError(f"{where}: {feature}.{k} is negative")
    return out


def _aggregate(episodes: list[dict[str, dict[str, np.ndarray]]], where: str) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for feature in episodes[0]:
        per = [e[feature] for e in episodes if feature in e]
        if any(k not in p for p in per for k in ("mean", "std", "count")):
            raise ValueError(f"{where}: feature {feature!r} lacks mean/std/count in some episode")
        c = np.array([float(np.sum(p["count"])) for p in per])
        if not c.sum() > 0:
            raise ValueError(f"{where}: feature {feature!r} has no counted frames (every count is 0)")
        means = np.stack([p["mean"] for p in per])
        w = (c / c.sum()).reshape((-1,) + (1,) * (means.ndim - 1))
        mean = np.sum(w * means, axis=0)
        var = np.sum(w * (np.stack([p["std"] for p in per]) ** 2 + (means - mean) ** 2), axis=0)
        agg = {"mean": mean, "std": np.sqrt(var), "count": np.array([c.sum()])}
        if all("min" in p and "max" in p for p in per):
            agg["min"] = np.min(np.stack([p["min"] for p in per]), axis=0)
            agg["max"] = np.max(np.stack([p["max"] for p in per]), axis=0)
        out[feature] = agg
    return out


def read_stats(meta: DatasetMeta) -> dict[str, dict[str, np.ndarray]]:
    """{feature: {stat: float64 array}} (see the module docstring); {} when the dataset has no statistics."""
    path = meta.root / "meta" / "stats.json"
    if path.is_file():
        stats = read_json(path)
        if not isinstance(stats, dict):
            raise ValueError(f"{path}: expected a JSON object of features")
        return _arrays(stats, str(path))
    path = meta.root / "meta" / "episodes_stats.jsonl"
    if not path.is_file():
        return {}
    rows = read_jsonl(path)
    if not rows:
        return {}
    if any(not isinstance(r.get("stats"), dict) for r in rows):
        raise ValueError(f"{path}: every line needs a 'stats' object")
    return _aggregate([_arrays(r["stats"], str(path)) for r in rows], str(path))


def norm_stats(stats: dict[str, dict[str, np.ndarray]], key: str) -> NormStats:
    """The project's `NormStats` of one vector feature (q01 / q99 when the file has them)."""
    if key not in stats:
        raise ValueError(f"statistics have no feature {key!r} (have {sorted(stats)}); pass the dataset's state or "
                         "action key")
    s = stats[key]
    return NormStats(mean=s["mean"].reshape(-1), std=s["std"].reshape(-1),
                     q01=s["q01"].reshape(-1) if "q01" in s else None,
                     q99=s["q99"].reshape(-1) if "q99" in s else None)
