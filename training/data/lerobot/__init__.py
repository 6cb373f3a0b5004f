"""LeRobot datasets (codebase v3.0 and v2.x) without torch: pyarrow for parquet, PyAV for video (docs/lerobot.md).

    from training.data.lerobot import LeRobotSource, KeyMap
    src = LeRobotSource("path/to/dataset", action_horizon=10)   # frames in the project's frame-dict layout
    src[0]["image"], src[0]["memory"], src.texts(0)               # texts: no image decoding
"""

# Metadata: info.json, episodes, tasks, statistics.
from training.data.lerobot.meta import DatasetMeta, Episode, read_meta
from training.data.lerobot.stats import norm_stats, read_stats

# Frames by feature name (LeRobot's own item layout) and as the project's frame dicts.
from training.data.lerobot.dataset import LeRobotDataset
from training.data.lerobot.keys import KeyMap
from training.data.lerobot.source import LeRobotSource

# Shuffled, per-host views of any random-access source.
from training.data.lerobot.sampling import ShardView, jax_shard, shard_order

# Per-frame text from the language columns.
from training.data.lerobot.language import active_at, emitted, speech

__all__ = [
    "DatasetMeta", "Episode", "read_meta", "norm_stats", "read_stats", "LeRobotDataset", "KeyMap", "LeRobotSource",
    "ShardView", "jax_shard", "shard_order", "active_at", "emitted", "speech",
]
