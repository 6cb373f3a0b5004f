"""Memory-annotated LIBERO frames without demonstrations: place objects, let physics settle, label.

Setup (an optional extra, not part of CI; its own venv, outside the repository):

    python3 -m venv /work/venv-sim && /work/venv-sim/bin/pip install -r requirements.txt -r requirements-libero.txt
    MUJOCO_GL=egl /work/venv-sim/bin/libero-pro smoke --suite libero_10 --steps 2     # smoke test

Run (resumable: re-running the same command skips the frames already written), here the libero_10
run that made /work/data/libero_memory/libero10_v2 (the embedded demo was trained on the smaller v1; see
checkpoints/demo/README.md for both): the 50 stored init states
of tasks 0, 1, 4, 6, 7 (10 frames planned per init state; init states 40-49 are the held-out split) plus
240 *reset layouts* per task (4 frames each, all in the training split); 7,193 frames accepted (6,707
train from 1,389 layouts, 486 held out), 14 distinct labels, 0.21 s per accepted frame on 2 shared CPU
cores:

    MUJOCO_GL=egl nice -n 10 /work/venv-sim/bin/python -m training.data.libero --run libero10_v2 \
        --tasks 0,1,4,6,7 --variants 3 --resets 240 --reset-variants 1 \
        --export-tfds /work/data/libero_memory_tfds_v2

(Without `--resets` this is the earlier libero10_v1 run: the stored init states only, 2,466 frames.)

Layouts. LIBERO stores 50 initial states per task; a model trained on 40 of them learns those layouts
rather than what a goal region looks like. `--resets N` adds N layouts per task drawn by LIBERO's own
placement samplers (the environment's `_reset_internal`, i.e. `env.reset()` without reloading the model),
from the BDDL init regions the stored states were drawn from, with numpy's RNG seeded per (seed, task,
layout). Reset layout k has init index RESET_BASE + k = 1000 + k and always goes to the training split, so
the held-out split stays the stored init states 40-49: layouts never trained on, comparable across runs.

Tasks: by default every task whose goal has only `In`/`On` predicates (libero_10: 0, 1, 4, 5, 6, 7;
tasks 2, 3, 8, 9 also need `Turnon`/`Close`, i.e. joint edits, and are skipped). libero_10 task 5
("book in the back compartment of the caddy") is better left out: a book resting in that compartment
has its body origin ~3 mm below the region box that LIBERO's `In` tests, so its placements are
always rejected and only its "Done: nothing." frames remain.

For each task, initial state and subset of the goal's movable predicates (`In`/`On` of a free-joint
object), a frame is made like this:

1. restore the stored initial state (or draw the reset layout) without rendering and pre-settle it
   with the robot holding still (the stored states are not at rest); snapshot, and branch every subset
   from that snapshot;
2. teleport each chosen object above its target, dropped from the geometry below it (a downward ray
   over the object's footprint finds the supporting surface; the object's own lowest point then
   starts `--clearance` above it), with xy jitter, spreading objects that share a target inside it;
3. settle, evaluate every goal predicate with the environment's own predicate functions, and
   reject the frame if a chosen predicate does not hold, an object that was not moved moved more
   than `--max-displacement`, or any object tilted more than `--max-tilt` (a retry redraws the jitter);
4. render agentview and wrist once (flipped 180° like openpi's LIBERO client), and label from the
   predicates that actually hold: "Done: alphabet soup in basket; tomato sauce in basket.".

Output, under `<out>/<run>/`: `shards/shard_NNNNN.npz` (JPEG/PNG bytes of both cameras, the 8-dim
state), `index.jsonl` (one line per accepted frame: labels, predicate truth table, instruction,
task, init index, split, timings, shard and row), `rejected.jsonl`, `config.json`, `summary.json`.
A shard is written (atomically) before its index lines, so a crash loses at most one shard. Each
frame also carries a scene label for language pre-training ("Scene: ketchup, milk, basket on table;
alphabet soup in basket.": every free object's support) and the 8-dim state. `shards.iter_frames(run_dir)`
reads the frames back as dicts; `--export-tfds DIR` converts them with
`training.data.frames.write_memory_dataset` (splits "train" / "heldout", by init index);
`--showcase N` copies N held-out frames as PNGs (+ frames.json) to `<out>/showcase/`.

Axis legend: H, W image height and width; the state is [eef xyz (3), eef axis-angle (3), gripper
finger qpos (2)], as openpi's LIBERO client builds it (`oxygen_jax.robots.libero`).

Modules: `config` (GenConfig, frame keys and seeds), `scene` (the simulator side: TaskScene, make_frame),
`shards` (the run's storage), `generate` (planning, the run, summary and showcase), `export` (tfds) and
`__main__` (the command line).
"""
