"""A random π0.5 checkpoint in openpi's released layout, written leaf by leaf: full-size load and memory
benchmarks without downloading one, and tests of the readers against files orbax itself reads.

    stored = write_random_openpi(model_config("tiny"), root)   # root/params; float32 bytes written
    _, params = load_openpi_params(root / "params", layout="stacked")

orbax's own save copies every numpy leaf into a device array and compresses them all at once: at full size
(13 GB of float32) that passes 20 GiB on a 24 GiB machine. This writes the same files leaf by leaf instead:
each leaf a zarr v2 array of one zstd chunk in the item's OCDBT database (what orbax 0.12.8 writes from one
host), the tree in `_METADATA` as orbax lays it out, and `_CHECKPOINT_METADATA`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from oxygen_jax.models.pi05.config import ModelConfig
from oxygen_jax.models.pi05.params import openpi_shapes

_CHECKPOINT_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"


def _key_metadata(keys: tuple[str, ...]) -> dict:
    return {"key_metadata": [{"key": k, "key_type": 2} for k in keys],  # 2: a dict key
            "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}


def write_random_openpi(config: ModelConfig, root: Path) -> int:
    """Writes a random checkpoint of `config` under `root/params` (which must not exist); returns its float32 bytes.

    Every leaf is a view of one buffer of 0.02 * N(0, 1) float32 draws (seed 0) as long as the largest leaf:
    random data, so zstd finds nothing to compress, as in a trained checkpoint. Peak memory is that buffer.
    """
    import tensorstore as ts

    item = (Path(root) / "params").resolve()
    item.mkdir(parents=True, exist_ok=False)
    shapes = openpi_shapes(config)
    pool = np.random.default_rng(0).standard_normal(max(math.prod(s) for s in shapes.values()), dtype=np.float32)
    pool *= np.float32(0.02)
    tree, stored = {}, 0
    for key, shape in shapes.items():
        keys = ("params", *key.split("/"))
        leaf = pool[: math.prod(shape)].reshape(shape)
        spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{item}/", "path": ".".join(keys)},
                "metadata": {"shape": list(shape), "chunks": list(shape), "dtype": "<f4",
                             "compressor": {"id": "zstd", "level": 1}}}
        ts.open(spec, create=True).result().write(leaf).result()
        tree[str(keys)] = _key_metadata(keys) | {"value_metadata": {
            "value_type": "np.ndarray", "skip_deserialize": False, "write_shape": list(shape)}}
        stored += leaf.nbytes
    (item / "_METADATA").write_text(json.dumps({"tree_metadata": tree, "use_zarr3": False,
                                                "store_array_data_equal_to_fill_value": True, "custom_metadata": None}))
    now = time.time_ns()
    (item / "_CHECKPOINT_METADATA").write_text(json.dumps({
        "item_handlers": _CHECKPOINT_HANDLER, "metrics": {}, "performance_metrics": {},
        "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}))
    return stored
