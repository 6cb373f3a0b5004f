"""OxyGen's textual-memory annotations on LIBERO's raw HDF5 demonstrations: reading, their split, their
samplers and their metric, reproduced so that a model trained and evaluated here is comparable to theirs.

    data = open_oxygen_libero("annotations/", "libero_hdf5/")   # split seed 7, 5 held out per task, stride 8
    data.train[i]        # frame dict (training.data.frames): both cameras rotated 180°, state [8], texts
    data.eval            # 10 held-out frames per task, the greedy exact-match set
    normalize(pred) == normalize(target)                         # their exact match

From the command line (`training.memory` / `eval.memory_eval`): `--data ANNOTATIONS --libero-hdf5 HDF5_ROOT`.

Modules, in the order data flows:

    annotations   the JSONL layout, `FrameRef`, the target under either name (textual_memory / visual_memory)
    split         the per-task held-out draw and the kept frames of each demonstration
    sampling      the task/target-balanced training draws and the evaluation frame selection
    hdf5          frames from the raw HDF5 files (rotation, state), `OxygenLiberoSource`
    dataset       `open_oxygen_libero`: all of the above in one call
    metric        `normalize`, exact match, word F1
    __main__      `python -m training.data.oxygen_libero ANNOTATIONS`: the split's manifest (and frame lists as JSON)
    synthetic     small LIBERO-layout HDF5 + annotation files, for tests and trying the commands
    recipe.sh     the whole recipe on an openpi π0.5 base: train, then evaluate (docs/memory_lora.md)
"""

# The data
from training.data.oxygen_libero.annotations import MEMORY_TARGETS, FrameRef, annotation_files, read_demo
from training.data.oxygen_libero.dataset import OxygenLibero, open_oxygen_libero
from training.data.oxygen_libero.hdf5 import LiberoHdf5, OxygenLiberoSource

# The protocol
from training.data.oxygen_libero.metric import exact_match, normalize, oxygen_metrics, word_f1
from training.data.oxygen_libero.sampling import BalancedSampler, select_eval_frames
from training.data.oxygen_libero.split import Split, build_split, heldout_demos, kept_frames, task_seed

__all__ = [
    "MEMORY_TARGETS", "FrameRef", "annotation_files", "read_demo", "OxygenLibero", "open_oxygen_libero",
    "LiberoHdf5", "OxygenLiberoSource", "exact_match", "normalize", "oxygen_metrics", "word_f1",
    "BalancedSampler", "select_eval_frames", "Split", "build_split", "heldout_demos", "kept_frames", "task_seed",
]
