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

    MUJOCO_GL=egl nice -n 10 /work/venv-sim/bin/python -m training.libero_memory --run libero10_v2 \
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
alphabet soup in basket.": every free object's support) and the 8-dim state. `iter_frames(run_dir)`
reads the frames back as dicts; `--export-tfds DIR` converts them with
`training.memory_data.write_memory_dataset` (splits "train" / "heldout", by init index);
`--showcase N` copies N held-out frames as PNGs (+ frames.json) to `<out>/showcase/`.

Axis legend: H, W image height and width; the state is [eef xyz (3), eef axis-angle (3), gripper
finger qpos (2)], as openpi's LIBERO client builds it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from training import bddl_goals

DEFAULT_OUT = Path("/work/data/libero_memory")
_CAMERAS = {"image": "agentview_image", "wrist_image": "robot0_eye_in_hand_image"}
_NOOP = np.array([0, 0, 0, 0, 0, 0, -1.0])  # zero delta pose, gripper open (openpi's LIBERO wait action)
_PARK_Z = 5.0  # objects being placed wait this high, out of the way of the drop-height rays
_RAY_START_Z = 3.0
# Init index of reset layout k is RESET_BASE + k: LIBERO stores 50 initial states per task (indices 0-49),
# and a reset layout is a new draw from the same BDDL init regions (`_TaskScene.layout`).
RESET_BASE = 1000


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenConfig:
    """What to generate and how; `physics_key()` fields must match to resume a run."""

    suite: str = "libero_10"
    tasks: tuple[int, ...] | None = None  # None: every task whose goal has only movable In/On predicates
    inits: tuple[int, ...] = tuple(range(50))  # stored initial-state indices to use
    held_out: tuple[int, ...] = tuple(range(40, 50))  # init indices whose frames get split "heldout"
    variants: int = 3  # placements (jitter draws) per non-empty subset; the empty subset is made once
    resets: int = 0  # extra layouts per task sampled by environment resets (init index RESET_BASE + k)
    reset_variants: int = 1  # `variants` for the reset layouts
    retries: int = 1  # redraws of a rejected placement
    image_size: int = 224
    image_format: str = "jpeg"  # "jpeg" (quality below) or "png"
    jpeg_quality: int = 95
    presettle_steps: int = 10  # control steps (25 physics substeps each) after restoring an init state
    settle_steps: int = 8  # max control steps after placing; stops early once objects are at rest
    min_settle_steps: int = 3
    clearance: float = 0.01  # m between the object's lowest point and the surface below, at release
    jitter: float = 0.01  # m, uniform xy jitter around the target
    spread: float = 0.03  # m, offset of each of several objects that share one target
    max_displacement: float = 0.02  # m, allowed motion of objects that were not placed
    max_tilt_deg: float = 30.0
    shard_size: int = 64
    seed: int = 0

    def __post_init__(self):
        if self.image_format not in ("jpeg", "png"):
            raise ValueError(f"image_format={self.image_format!r}; use 'jpeg' or 'png'")
        if self.variants < 1 or self.reset_variants < 1 or self.retries < 0 or self.shard_size < 1:
            raise ValueError("variants, reset_variants and shard_size must be >= 1 and retries >= 0")
        if self.resets < 0:
            raise ValueError(f"resets must be >= 0, got {self.resets}")
        if any(i >= RESET_BASE for i in self.inits):
            raise ValueError(f"stored init indices must be < {RESET_BASE}; use resets for more layouts")
        if not 1 <= self.min_settle_steps <= self.settle_steps:
            raise ValueError(
                f"need 1 <= min_settle_steps ({self.min_settle_steps}) <= settle_steps ({self.settle_steps})"
            )

    def physics_key(self) -> dict:
        """Settings that change the frames; a resumed run must use the same ones."""
        skip = {"tasks", "inits", "held_out", "variants", "retries", "shard_size", "resets", "reset_variants"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


# ----------------------------------------------------------------------------- frame keys and splits


def frame_key(task: int, init: int, subset: Sequence[int], variant: int) -> str:
    """"t0-i07-s01-v1": task 0, init 7, goal predicates {0, 1} placed, variant 1 ("s-" for none); reset layout
    k has init RESET_BASE + k ("t0-i1003-...")."""
    return f"t{task}-i{init:02d}-s{''.join(map(str, subset)) or '-'}-v{variant}"


def _frame_rng(cfg: GenConfig, key: str, attempt: int) -> np.random.Generator:
    digest = hashlib.sha256(f"{cfg.seed}/{key}/{attempt}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def quat_to_axis_angle(quat_xyzw: np.ndarray) -> np.ndarray:
    """Unit quaternion (x, y, z, w) -> axis * angle [3]; zeros for the identity."""
    w = float(np.clip(quat_xyzw[3], -1.0, 1.0))
    s = np.sqrt(1.0 - w * w)
    if s < 1e-8:
        return np.zeros(3, np.float32)
    return (np.asarray(quat_xyzw[:3]) * (2.0 * np.arccos(w) / s)).astype(np.float32)


# ----------------------------------------------------------------------------- the simulator side


class _TaskScene:
    """One LIBERO task's environment plus what placement needs (free joints, geometry, names)."""

    def __init__(self, suite, task_id: int, cfg: GenConfig):
        import mujoco
        from libero.libero import get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        self.cfg = cfg
        self.task_id = task_id
        task = suite.get_task(task_id)
        self.task_name, self.instruction = task.name, task.language
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        t0 = time.perf_counter()
        self.env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=cfg.image_size, camera_widths=cfg.image_size)
        self.env.seed(0)
        self.env.reset()
        self.construct_s = time.perf_counter() - t0
        self.e = e = self.env.env
        self.m, self.d = e.sim.model._model, e.sim.data._data
        self.mujoco = mujoco
        problem = e.parsed_problem
        self.goal = bddl_goals.parse_goal(problem["goal_state"])
        self.names = bddl_goals.display_names(problem["objects"], problem["fixtures"])
        self.table = next((f for f in problem["fixtures"] if f.endswith("table")), "table")
        m = self.m
        self.free: dict[str, tuple[int, int, int]] = {}  # object -> (body id, qpos adr, qvel adr)
        for name in e.objects_dict:
            body = e.obj_body_id[name]
            joint = m.body_jntadr[body]
            if joint >= 0 and m.jnt_type[joint] == mujoco.mjtJoint.mjJNT_FREE:
                self.free[name] = (body, int(m.jnt_qposadr[joint]), int(m.jnt_dofadr[joint]))
        self.placeable = bddl_goals.placement_predicates(self.goal, self.free)
        container_suffixes = ("_contain_region", "_cook_region", "_heating_region")
        self.containers = [s for s in e.object_sites_dict if s.endswith(container_suffixes)]
        # Collision geoms (group 0 in robosuite) of each free object's subtree; robot bodies to see through.
        root = m.body_rootid
        self.geoms = {
            n: np.flatnonzero(
                (root[m.geom_bodyid] == root[b]) & (m.geom_group == 0) & ((m.geom_contype | m.geom_conaffinity) != 0)
            )
            for n, (b, _, _) in self.free.items()
        }
        body_names = [mujoco.mj_id2name(m, mujoco.mjtObj.mjOBJ_BODY, b) or "" for b in range(m.nbody)]
        robot_roots = {root[b] for b, name in enumerate(body_names) if name.startswith(("robot", "gripper", "mount"))}
        self.robot_body = np.isin(root, list(robot_roots))
        self.substeps = int(round(e.control_timestep / e.model_timestep))
        self.init_states = suite.get_task_init_states(task_id)
        self._body_pos, self._body_quat = m.body_pos.copy(), m.body_quat.copy()

    # -- physics

    def hold_still(self, n: int, min_steps: int | None = None) -> int:
        """Hold the robot still for up to n control steps (env.step without rendering); early exit at rest."""
        e = self.e
        for step in range(1, n + 1):
            policy_step = True
            for _ in range(self.substeps):
                e.sim.forward()
                e._pre_action(_NOOP, policy_step)
                e.sim.step()
                policy_step = False
            if min_steps is not None and step >= min_steps and self._at_rest():
                return step
        return n

    def _at_rest(self, lin: float = 0.01, ang: float = 0.2) -> bool:
        qvel = self.d.qvel
        dofs = [v for _, _, v in self.free.values()]
        return all(np.abs(qvel[v : v + 3]).max() < lin and np.abs(qvel[v + 3 : v + 6]).max() < ang for v in dofs)

    def restore(self, flat_state: np.ndarray) -> None:
        self.e.sim.set_state_from_flattened(flat_state)
        self.e.sim.forward()

    def layout(self, init: int) -> np.ndarray:
        """The flattened start state of layout `init`: a stored initial state (init < RESET_BASE), or reset
        layout k = init - RESET_BASE, drawn by LIBERO's own placement samplers (`_reset_internal`, no model
        reload) with numpy's global RNG seeded from (seed, task, k), so a layout is reproducible on its own."""
        if init < RESET_BASE:
            return self.init_states[init]
        digest = hashlib.sha256(f"{self.cfg.seed}/reset/{self.task_id}/{init - RESET_BASE}".encode()).digest()
        state = np.random.get_state()
        np.random.seed(int.from_bytes(digest[:4], "little"))
        try:
            self.e.sim.reset()
            self.e._reset_internal()
        finally:
            np.random.set_state(state)
        # Fixtures stay where the stored states have them (a reset may move fixture bodies in the model).
        self.m.body_pos[:], self.m.body_quat[:] = self._body_pos, self._body_quat
        self.e.sim.forward()
        return self.e.sim.get_state().flatten().copy()

    def presettle(self, init: int) -> np.ndarray:
        """Restore layout `init` (`layout`), let it come to rest; the flattened state to branch from."""
        self.restore(self.layout(init))
        self.hold_still(self.cfg.presettle_steps)
        return self.e.sim.get_state().flatten().copy()

    def poses(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Free object -> (position [3], rotation matrix [3, 3]) of its body."""
        return {n: (self.d.xpos[b].copy(), self.d.xmat[b].reshape(3, 3).copy()) for n, (b, _, _) in self.free.items()}

    # -- geometry

    def _corners(self, name: str) -> np.ndarray:
        """Corners of the object's collision-geom bounding boxes, in its body frame [8 * n_geoms, 3]."""
        m, d = self.m, self.d
        body = self.free[name][0]
        signs = np.array([[i, j, k] for i in (-1, 1) for j in (-1, 1) for k in (-1, 1)], float)
        world = []
        for g in self.geoms[name]:
            local = m.geom_aabb[g, :3] + m.geom_aabb[g, 3:] * signs
            world.append(d.geom_xpos[g] + local @ d.geom_xmat[g].reshape(3, 3).T)
        return (np.concatenate(world) - d.xpos[body]) @ d.xmat[body].reshape(3, 3)

    def _orientation(
        self, corners: np.ndarray, rot0: np.ndarray, target_rot: np.ndarray, room: np.ndarray | None
    ) -> np.ndarray:
        """The body rotation to place with: the current one, unless its footprint does not fit `room`.

        `room` is the target's xy half-extent (target frame) for containers, else None. Candidates
        turn the object about z in 15° steps, optionally after tipping it 90° about a horizontal
        axis; the least-turned candidate that fits wins (a book is yawed to enter a narrow caddy
        compartment), else the one that fits best.
        """
        if room is None:
            return rot0
        def rx(a): return np.array([[1, 0, 0], [0, np.cos(a), -np.sin(a)], [0, np.sin(a), np.cos(a)]])
        def ry(a): return np.array([[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]])
        def rz(a): return np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
        yaws = sorted(np.radians(np.arange(-90, 91, 15)), key=abs)
        turns = [rz(y) @ tip for tip in (np.eye(3), rx(np.pi / 2), ry(np.pi / 2)) for y in yaws]
        best, best_margin = rot0, -np.inf
        for turn in turns:
            rot = turn @ rot0
            half = np.abs((corners @ rot.T) @ target_rot)[:, :2].max(axis=0)
            margin = float(np.min(room - half))
            if margin >= 0.0:
                return rot
            if margin > best_margin:
                best, best_margin = rot, margin
        return best

    def _surface_z(self, xy: np.ndarray) -> float:
        """Highest non-robot collision surface straight below xy (a downward ray, seeing through the robot)."""
        mj, m, d = self.mujoco, self.m, self.d
        groups = np.array([1, 0, 0, 0, 0, 0], np.uint8)
        start = np.array([xy[0], xy[1], _RAY_START_Z])
        geom = np.zeros(1, np.int32)
        for _ in range(20):
            dist = mj.mj_ray(m, d, start, np.array([0.0, 0.0, -1.0]), groups, 1, -1, geom)
            if dist < 0:
                return 0.0
            start = start - np.array([0, 0, dist + 1e-4])
            if not self.robot_body[m.geom_bodyid[geom[0]]]:
                return float(start[2])
        return float(start[2])

    def _target(self, place: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """(center [3], xy half-extent [2], rotation [3, 3], is a container region) of an In/On target."""
        e = self.e
        if place in e.object_sites_dict:
            center = e.sim.data.get_site_xpos(place).copy()
            rot = e.sim.data.get_site_xmat(place).reshape(3, 3).copy()
            half = np.abs(np.asarray(e.object_sites_dict[place].size, float)[:2])
            return center, half, rot, place in self.containers
        body = e.obj_body_id[place]
        # `On(a, object)` holds within 3 cm of the object's body origin in xy.
        return self.d.xpos[body].copy(), np.array([0.015, 0.015]), np.eye(3), False

    def place(self, chosen: Sequence[bddl_goals.Predicate], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Teleport each chosen predicate's object onto its target, at rest; their release rotations.

        The object keeps its orientation unless it does not fit a container (`_orientation`); its
        lowest point starts `clearance` above the highest surface under its footprint.
        """
        mj, m, d = self.mujoco, self.m, self.d
        shapes = {
            p.args[0]: (self._corners(p.args[0]), d.xmat[self.free[p.args[0]][0]].reshape(3, 3).copy()) for p in chosen
        }
        for i, p in enumerate(chosen):  # park them first so the rays do not hit one another's old poses
            _, qadr, vadr = self.free[p.args[0]]
            d.qpos[qadr : qadr + 3] = (10.0 + i, 10.0, _PARK_Z)
            d.qvel[vadr : vadr + 6] = 0.0
        mj.mj_kinematics(m, d)
        sharing = collections.Counter(p.args[1] for p in chosen)
        seen: collections.Counter = collections.Counter()
        angle = rng.uniform(0, np.pi)
        released = {}
        for p in chosen:
            obj, place = p.args
            corners, rot0 = shapes[obj]
            center, half, target_rot, container = self._target(place)
            rot = self._orientation(corners, rot0, target_rot, half if container else None)
            offsets = corners @ rot.T  # world-frame offsets of the corners from the body origin
            own_half = np.abs(offsets @ target_rot)[:, :2].max(axis=0)
            shift = rng.uniform(-self.cfg.jitter, self.cfg.jitter, size=2)
            n = sharing[place]
            if n > 1:  # spread evenly along a random line through the target
                step = self.cfg.spread * (seen[place] - (n - 1) / 2) * (2 if n == 2 else 1)
                shift = shift + step * np.array([np.cos(angle), np.sin(angle)])
            seen[place] += 1
            # Stay inside the target: the whole footprint for containers, the body origin otherwise.
            limit = np.maximum(half - own_half, 0.0) if container else 0.8 * half
            xy = center[:2] + target_rot[:2, :2] @ np.clip(target_rot[:2, :2].T @ shift, -limit, limit)
            hx, hy = 0.8 * np.abs(offsets[:, :2]).max(axis=0)
            footprint = [xy + np.array(u) for u in ((0, 0), (hx, hy), (hx, -hy), (-hx, hy), (-hx, -hy))]
            surface = max(self._surface_z(q) for q in footprint)
            z = surface - offsets[:, 2].min() + self.cfg.clearance
            _, qadr, vadr = self.free[obj]
            quat = np.zeros(4)
            mj.mju_mat2Quat(quat, rot.flatten())
            d.qpos[qadr : qadr + 3] = (xy[0], xy[1], z)
            d.qpos[qadr + 3 : qadr + 7] = quat
            d.qvel[vadr : vadr + 6] = 0.0
            mj.mj_kinematics(m, d)  # the next object's rays see this one
            released[obj] = rot
        self.e.sim.forward()
        return released

    # -- evaluation and rendering

    def evaluate(self) -> list[bool]:
        return [bool(self.e._eval_predicate(p.as_list())) for p in self.goal]

    def supports(self) -> list[tuple[str, str, str]]:
        """(object, "in"/"on", support) for every free object: a container region, another object, or the table."""
        from libero.libero.envs.predicates import eval_predicate_fn

        states = self.e.object_states_dict
        poses = self.poses()
        out = []
        for obj in self.free:
            support = ("on", self.table)
            for region in self.containers:
                if region.startswith(obj + "_"):
                    continue
                if eval_predicate_fn("in", states[obj], states[region]):
                    support = ("in", region)
                    break
            else:
                for other in self.free:
                    close = np.linalg.norm(poses[obj][0][:2] - poses[other][0][:2]) < 0.03
                    if other != obj and close and eval_predicate_fn("on", states[obj], states[other]):
                        support = ("on", other)
                        break
            out.append((obj, *support))
        return out

    def render(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Both cameras (uint8 [H, W, 3], rotated 180°) and the 8-dim state."""
        obs = self.e._get_observations(force_update=True)
        images = {k: np.ascontiguousarray(obs[cam][::-1, ::-1]) for k, cam in _CAMERAS.items()}
        state = np.concatenate(
            [obs["robot0_eef_pos"], quat_to_axis_angle(obs["robot0_eef_quat"]), obs["robot0_gripper_qpos"]]
        ).astype(np.float32)
        return images, state

    def close(self):
        self.env.close()


def _tilt_deg(rot_a: np.ndarray, rot_b: np.ndarray) -> float:
    """Angle between the body z axes of two rotations [3, 3] (yaw does not count)."""
    return float(np.degrees(np.arccos(np.clip(rot_a[:, 2] @ rot_b[:, 2], -1.0, 1.0))))


def _rotation_deg(rot_a: np.ndarray, rot_b: np.ndarray) -> float:
    """Angle of the rotation between two rotations [3, 3]."""
    return float(np.degrees(np.arccos(np.clip((np.trace(rot_a.T @ rot_b) - 1.0) / 2.0, -1.0, 1.0))))


def make_frame(scene: _TaskScene, snapshot: np.ndarray, subset: Sequence[int], rng: np.random.Generator) -> dict:
    """Branch from `snapshot`, place the predicates `subset` (indices into scene.placeable), settle, check.

    Returns a record with "accepted" (bool), "reasons" (why not), labels, the truth table and
    timings; accepted records also carry "images" and "state".
    """
    cfg = scene.cfg
    timings = {}
    t0 = time.perf_counter()
    scene.restore(snapshot)
    before = scene.poses()
    chosen = [scene.placeable[i] for i in subset]
    released = scene.place(chosen, rng) if chosen else {}
    reference = {**before, **{obj: (None, rot) for obj, rot in released.items()}}  # tilt is measured from release
    timings["place_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps = scene.hold_still(cfg.settle_steps, cfg.min_settle_steps)
    timings["settle_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    truth = scene.evaluate()
    after = scene.poses()
    moved = {p.args[0] for p in chosen}
    reasons = [f"placement_failed {p}" for p in chosen if not truth[scene.goal.index(p)]]
    for obj in scene.free:
        shift = float(np.linalg.norm(after[obj][0] - before[obj][0]))
        if obj not in moved and shift > cfg.max_displacement:
            reasons.append(f"collateral_motion {obj} {shift:.3f}m")
        tilt = _tilt_deg(after[obj][1], reference[obj][1])
        if tilt > cfg.max_tilt_deg:
            reasons.append(f"tilt {obj} {tilt:.0f}deg")
    satisfied = [p for p, v in zip(scene.goal, truth) if v]
    supports = scene.supports()
    timings["eval_s"] = time.perf_counter() - t0
    record = {
        "accepted": not reasons,
        "reasons": reasons,
        "memory": bddl_goals.memory_label(satisfied, scene.names),
        "scene": bddl_goals.scene_label(supports, scene.names),
        "placed": [str(p) for p in chosen],
        "predicates": bddl_goals.truth_table(scene.goal, truth),
        "supports": [list(s) for s in supports],
        "turned": sorted(obj for obj, rot in released.items() if _rotation_deg(rot, before[obj][1]) > 1.0),
        "settle_steps": steps,
    }
    if not reasons:
        t0 = time.perf_counter()
        record["images"], record["state"] = scene.render()
        timings["render_s"] = time.perf_counter() - t0
    record["timings"] = {k: round(v, 4) for k, v in timings.items()}
    return record


# ----------------------------------------------------------------------------- storage


def _encode(image: np.ndarray, fmt: str, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    else:
        Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _decode(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash
            continue
    return rows


def _repair_jsonl(path: Path) -> None:
    """Drop a last line cut by a crash (no trailing newline), so appends start on a fresh line."""
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)


def _append_jsonl(path: Path, rows: Sequence[dict]) -> None:
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


class _ShardWriter:
    """Buffers accepted frames; each flush writes one npz shard atomically, then its index lines."""

    def __init__(self, run_dir: Path, cfg: GenConfig):
        self.run_dir, self.cfg = run_dir, cfg
        (run_dir / "shards").mkdir(parents=True, exist_ok=True)
        for log in ("index.jsonl", "rejected.jsonl"):
            _repair_jsonl(run_dir / log)
        indexed = {r["shard"] for r in _read_jsonl(run_dir / "index.jsonl")}
        for path in (run_dir / "shards").glob("shard_*.npz"):  # written but never indexed: a crash
            if path.name not in indexed:
                path.unlink()
        for path in (run_dir / "shards").glob("*.tmp.npz"):
            path.unlink()
        existing = [int(p.stem.split("_")[1]) for p in (run_dir / "shards").glob("shard_*.npz")]
        self.next_shard = max(existing, default=-1) + 1
        self.rows: list[dict] = []
        self.images: dict[str, list[bytes]] = {k: [] for k in _CAMERAS}
        self.states: list[np.ndarray] = []

    def add(self, row: dict, images: dict[str, np.ndarray], state: np.ndarray) -> None:
        """Encode and buffer one frame (its encode time goes into row["timings"]); flush a full shard."""
        t0 = time.perf_counter()
        for k in _CAMERAS:
            self.images[k].append(_encode(images[k], self.cfg.image_format, self.cfg.jpeg_quality))
        row["timings"]["encode_s"] = round(time.perf_counter() - t0, 4)
        self.rows.append(row)
        self.states.append(state)
        if len(self.rows) >= self.cfg.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        name = f"shard_{self.next_shard:05d}.npz"
        arrays = {"state": np.stack(self.states), "key": np.array([r["key"] for r in self.rows])}
        for k, blobs in self.images.items():
            arrays[k] = np.frombuffer(b"".join(blobs), np.uint8)
            arrays[k + "_offsets"] = np.cumsum([0] + [len(b) for b in blobs]).astype(np.int64)
        tmp = self.run_dir / "shards" / f"{name[:-4]}.tmp.npz"
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, self.run_dir / "shards" / name)
        _append_jsonl(self.run_dir / "index.jsonl", [dict(r, shard=name, row=i) for i, r in enumerate(self.rows)])
        self.next_shard += 1
        self.rows, self.states = [], []
        self.images = {k: [] for k in _CAMERAS}


def iter_frames(run_dir: str | Path, split: str | None = None) -> Iterator[dict]:
    """Accepted frames of a run as dicts: the index row plus "image", "wrist_image" (uint8 [H, W, 3]) and
    "state" (float32 [8])."""
    run_dir = Path(run_dir)
    rows = [r for r in _read_jsonl(run_dir / "index.jsonl") if split is None or r["split"] == split]
    by_shard: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_shard[r["shard"]].append(r)
    for shard, shard_rows in sorted(by_shard.items()):
        with np.load(run_dir / "shards" / shard) as z:
            arrays = {k: z[k] for k in z.files}
        for r in shard_rows:
            i = r["row"]
            frame = dict(r, state=arrays["state"][i])
            for k in _CAMERAS:
                lo, hi = arrays[k + "_offsets"][i : i + 2]
                frame[k] = _decode(arrays[k][lo:hi].tobytes())
            yield frame


# ----------------------------------------------------------------------------- the run


def _suite(name: str):
    from libero.libero import benchmark

    suites = benchmark.get_benchmark_dict()
    if name not in suites:
        raise SystemExit(f"unknown LIBERO suite {name!r}; choose from {sorted(suites)}")
    return suites[name]()


def _task_problem(suite, task_id: int) -> dict:
    """The task's parsed BDDL problem (goal, objects, fixtures), without building the simulator."""
    from libero.libero import get_libero_path
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    if not 0 <= task_id < suite.n_tasks:
        raise SystemExit(f"task {task_id} is not in the suite (it has tasks 0-{suite.n_tasks - 1})")
    task = suite.get_task(task_id)
    return robosuite_parse_problem(os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file))


def _planned_placeable(problem: dict) -> tuple[bddl_goals.Predicate, ...]:
    """Goal In/On predicates whose subject is a BDDL object (LIBERO objects have free joints; checked later)."""
    objects = [o for instances in problem["objects"].values() for o in instances]
    return bddl_goals.placement_predicates(bddl_goals.parse_goal(problem["goal_state"]), objects)


def _default_tasks(suite) -> list[int]:
    """Tasks whose goal has only In/On predicates (articulation goals need joint edits, not placements)."""
    goals = {t: bddl_goals.parse_goal(_task_problem(suite, t)["goal_state"]) for t in range(suite.n_tasks)}
    return [t for t, goal in goals.items() if all(p.is_placement for p in goal)]


def _plan(cfg: GenConfig, k: int, init: int = 0) -> list[tuple[tuple[int, ...], int]]:
    """(subset, variant) pairs of one layout: the empty subset once, the others cfg.variants times
    (cfg.reset_variants for reset layouts, init >= RESET_BASE)."""
    n = cfg.reset_variants if init >= RESET_BASE else cfg.variants
    return [(s, v) for s in bddl_goals.goal_subsets(k) for v in range(n if s else 1)]


def layout_inits(cfg: GenConfig) -> list[int]:
    """Every layout's init index: the stored ones, then RESET_BASE + k for k < cfg.resets."""
    return [*cfg.inits, *range(RESET_BASE, RESET_BASE + cfg.resets)]


def _check_run_config(run_dir: Path, cfg: GenConfig) -> None:
    path = run_dir / "config.json"
    key = cfg.physics_key()
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in key.items() if old.get(k) != v}
        if diff:
            raise SystemExit(
                f"{run_dir} was made with other settings {diff} (old, new); use a new --run name or the old settings"
            )
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(key, indent=1) + "\n")


def generate(cfg: GenConfig, run_dir: Path) -> None:
    """Make every pending frame of the run (resuming), then write summary.json and print the summary."""
    from tqdm import tqdm

    _check_run_config(run_dir, cfg)
    done = {r["key"] for r in _read_jsonl(run_dir / "index.jsonl") if (run_dir / "shards" / r["shard"]).exists()}
    attempts = collections.Counter(r["key"] for r in _read_jsonl(run_dir / "rejected.jsonl"))

    def pending(key: str, subset: tuple[int, ...]) -> bool:
        return key not in done and attempts[key] <= (cfg.retries if subset else 0)

    suite = _suite(cfg.suite)
    tasks = list(cfg.tasks) if cfg.tasks is not None else _default_tasks(suite)
    n_inits = len(suite.get_task_init_states(tasks[0])) if tasks else 0
    if any(i >= n_inits for i in cfg.inits):
        raise SystemExit(f"--inits goes up to {max(cfg.inits)} but the suite stores {n_inits} initial states per task")
    work = {}  # task -> (placeable, {init: [(subset, variant), ...]})
    for task_id in tasks:
        placeable = _planned_placeable(_task_problem(suite, task_id))
        todo = {i: [(s, v) for s, v in _plan(cfg, len(placeable), i) if pending(frame_key(task_id, i, s, v), s)]
                for i in layout_inits(cfg)}
        work[task_id] = placeable, {i: items for i, items in todo.items() if items}
    total = sum(len(items) for _, todo in work.values() for items in todo.values())
    print(f"tasks {tasks}; {len(cfg.inits)} stored inits, {len(cfg.held_out)} of them held out, {cfg.resets} reset "
          f"layouts per task; "
          f"{len(done)} frames already written, {total} to make", flush=True)
    held_out = set(cfg.held_out)
    writer = _ShardWriter(run_dir, cfg)
    bar = tqdm(total=total, unit="frame", dynamic_ncols=True, mininterval=10.0)
    counts = collections.Counter()
    try:
        for task_id, (placeable, todo) in work.items():
            if not todo:
                continue
            bar.set_description(f"task {task_id} (building env)")
            scene = _TaskScene(suite, task_id, cfg)
            if scene.placeable != placeable:
                raise RuntimeError(
                    f"task {task_id}: placeable predicates {scene.placeable} differ from the BDDL plan {placeable}"
                )
            bar.set_description(f"task {task_id}")
            tqdm.write(f"task {task_id} {scene.task_name}: env built in {scene.construct_s:.1f}s; placeable "
                       f"{[str(p) for p in placeable]}; {sum(map(len, todo.values()))} frames to make")
            for init, items in todo.items():
                t0 = time.perf_counter()
                snapshot = scene.presettle(init)
                presettle_s = time.perf_counter() - t0
                for subset, variant in items:
                    key = frame_key(task_id, init, subset, variant)
                    meta = {
                        "key": key, "task": task_id, "task_name": scene.task_name, "init_index": init,
                        "subset": list(subset), "variant": variant, "split": "heldout" if init in held_out else "train",
                        "language_instruction": scene.instruction,
                    }
                    while pending(key, subset):
                        record = make_frame(scene, snapshot, subset, _frame_rng(cfg, key, attempts[key]))
                        timings = dict(record.pop("timings"), presettle_s=round(presettle_s, 4))
                        presettle_s = 0.0  # shared by the frames of this init: charged to its first attempt
                        row = {**meta, "attempt": attempts[key], **record, "timings": timings}
                        if record["accepted"]:
                            images, state = row.pop("images"), row.pop("state")
                            row["state"] = [round(float(x), 6) for x in state]
                            writer.add(row, images, state)
                            done.add(key)
                            counts["accepted"] += 1
                        else:
                            _append_jsonl(run_dir / "rejected.jsonl", [row])
                            attempts[key] += 1
                            counts["rejected"] += 1
                    bar.update(1)
                    bar.set_postfix(ok=counts["accepted"], rejected=counts["rejected"],
                                    s_per_frame=f"{bar.format_dict['elapsed'] / max(bar.n, 1):.2f}", refresh=False)
            scene.close()
    finally:
        writer.flush()
        bar.close()
    print_summary(summarize(run_dir))


# ----------------------------------------------------------------------------- summary, showcase, export


def summarize(run_dir: str | Path) -> dict:
    """Counts and timings of a run from its index and rejection log; also written to summary.json."""
    run_dir = Path(run_dir)
    ok, rejected = _read_jsonl(run_dir / "index.jsonl"), _read_jsonl(run_dir / "rejected.jsonl")
    labels = collections.Counter(r["memory"] for r in ok)
    reasons = collections.Counter(reason.split(" ")[0] for r in rejected for reason in r["reasons"])
    # "tilt basket_1 41deg" -> "tilt basket_1": the kind and what it concerns, without the amount.
    details = collections.Counter(
        " ".join(w for w in reason.split() if not w[0].isdigit()) for r in rejected for reason in r["reasons"]
    )

    def per_task(rows):
        return dict(sorted(collections.Counter(f"{r['task']} {r['task_name']}" for r in rows).items()))

    def median(rows, field):
        values = [r["timings"].get(field) for r in rows if r["timings"].get(field)]
        return round(statistics.median(values), 4) if values else None

    frame_s = [sum(v for k, v in r["timings"].items()) for r in ok + rejected]
    summary = {
        "accepted": len(ok),
        "rejected_attempts": len(rejected),
        "accepted_per_task": per_task(ok),
        "rejected_per_task": per_task(rejected),
        "accepted_per_split": dict(collections.Counter(r["split"] for r in ok)),
        "rejection_reasons": dict(reasons.most_common()),
        "rejection_details": dict(details.most_common()),
        "label_histogram": dict(labels.most_common()),
        "distinct_labels": len(labels),
        "majority_label_share": round(labels.most_common(1)[0][1] / len(ok), 4) if ok else None,
        "distinct_scene_labels": len({r["scene"] for r in ok}),
        "median_s": {f: median(ok, f) for f in ("presettle_s", "place_s", "settle_s", "eval_s", "render_s",
                                                 "encode_s")},
        "mean_s_per_attempt": round(sum(frame_s) / len(frame_s), 4) if frame_s else None,
        "mean_s_per_accepted_frame": round(sum(frame_s) / len(ok), 4) if ok else None,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def print_summary(s: dict) -> None:
    print(f"\naccepted frames: {s['accepted']}   rejected attempts: {s['rejected_attempts']}   "
          f"per split: {s['accepted_per_split']}")
    print("per task (accepted / rejected attempts):")
    for task in sorted(set(s["accepted_per_task"]) | set(s["rejected_per_task"])):
        print(f"  {task}: {s['accepted_per_task'].get(task, 0)} / {s['rejected_per_task'].get(task, 0)}")
    print("rejection reasons:", s["rejection_reasons"] or "none")
    for detail, n in s["rejection_details"].items():
        print(f"  {n:6d}  {detail}")
    print(f"labels ({s['distinct_labels']} distinct, majority share {s['majority_label_share']}):")
    for label, n in s["label_histogram"].items():
        print(f"  {n:6d}  {label}")
    print(f"distinct scene labels: {s['distinct_scene_labels']}")
    print(f"median seconds per frame: {s['median_s']}; mean s/attempt {s['mean_s_per_attempt']}, "
          f"s/accepted frame {s['mean_s_per_accepted_frame']} (presettle shared by an init's frames)")


def write_showcase(run_dir: Path, out_dir: Path, n: int) -> list[dict]:
    """Copy n held-out frames (both cameras as PNG) with their labels to out_dir, varying task and label."""
    from PIL import Image

    frames = list(iter_frames(run_dir, split="heldout"))
    if not frames:
        raise SystemExit(f"no held-out frames in {run_dir}; generate some first")
    by_task: dict[int, list[dict]] = collections.defaultdict(list)
    for f in frames:
        by_task[f["task"]].append(f)
    picked, labels = [], set()
    while len(picked) < n and any(by_task.values()):  # round-robin over tasks, a new label when there is one
        for candidates in by_task.values():
            if candidates and len(picked) < n:
                i = next((i for i, c in enumerate(candidates) if c["memory"] not in labels), 0)
                f = candidates.pop(i)
                picked.append(f)
                labels.add(f["memory"])
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = []
    for f in picked:
        for k in _CAMERAS:
            Image.fromarray(f[k]).save(out_dir / f"{f['key']}_{k}.png", optimize=True)
        keep = ("key", "task", "init_index", "split", "language_instruction", "memory", "scene", "predicates")
        meta.append({k: f[k] for k in keep} | {"state": [float(x) for x in f["state"]]}
                    | {k: f"{f['key']}_{k}.png" for k in _CAMERAS})
    (out_dir / "frames.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.libero_memory",
        description="Generate memory-annotated LIBERO frames by placing objects (no demonstrations needed). "
        "Resumable: re-run the same command to continue. Needs the simulator venv (see the module docstring) "
        "and MUJOCO_GL=egl.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = GenConfig()
    p.add_argument("--run", default="main", help="run name: frames go to OUT/RUN/")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output root (outside the repository)")
    p.add_argument("--suite", default=d.suite, help="LIBERO suite")
    p.add_argument("--tasks", default="", help="task ids, e.g. '0,1,4-7'; default: tasks whose goals are only In/On")
    p.add_argument("--inits", default="0-49", help="stored initial-state indices")
    p.add_argument("--held-out", default="40-49", help="init indices whose frames form the held-out split")
    p.add_argument("--variants", type=int, default=d.variants, help="placements per non-empty predicate subset")
    p.add_argument("--resets", type=int, default=d.resets,
                   help=f"extra layouts per task drawn by environment resets (init index {RESET_BASE}+k, split train)")
    p.add_argument("--reset-variants", type=int, default=d.reset_variants,
                   help="placements per non-empty predicate subset of a reset layout")
    p.add_argument("--retries", type=int, default=d.retries, help="redraws of a rejected placement")
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--image-format", choices=("jpeg", "png"), default=d.image_format)
    p.add_argument("--jpeg-quality", type=int, default=d.jpeg_quality)
    p.add_argument("--presettle-steps", type=int, default=d.presettle_steps,
                   help="control steps (25 substeps) after restoring")
    p.add_argument("--settle-steps", type=int, default=d.settle_steps, help="max control steps after placing")
    p.add_argument("--clearance", type=float, default=d.clearance,
                   help="m from an object's lowest point to the surface at release")
    p.add_argument("--jitter", type=float, default=d.jitter, help="m of uniform xy jitter")
    p.add_argument("--spread", type=float, default=d.spread, help="m between objects that share a target")
    p.add_argument("--max-displacement", type=float, default=d.max_displacement,
                   help="m; reject if an unplaced object moves more")
    p.add_argument("--max-tilt", type=float, default=d.max_tilt_deg, help="degrees; reject if any object tilts more")
    p.add_argument("--shard-size", type=int, default=d.shard_size, help="frames per npz shard")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--list-tasks", action="store_true", help="print the suite's tasks and goals, then exit")
    p.add_argument("--summary-only", action="store_true", help="print the run's summary without generating")
    p.add_argument("--showcase", type=int, default=0, metavar="N",
                   help="after generating, copy N held-out frames as PNG to OUT/showcase/")
    p.add_argument("--export-tfds", type=Path, default=None, metavar="DIR",
                   help="after generating, convert the run with training.memory_data.write_memory_dataset")
    return p


def _config_from_args(args) -> GenConfig:
    parse = bddl_goals.parse_index_ranges
    return GenConfig(
        suite=args.suite, tasks=tuple(parse(args.tasks)) if args.tasks else None, inits=tuple(parse(args.inits)),
        held_out=tuple(parse(args.held_out)), variants=args.variants, resets=args.resets,
        reset_variants=args.reset_variants, retries=args.retries, image_size=args.image_size,
        image_format=args.image_format, jpeg_quality=args.jpeg_quality, presettle_steps=args.presettle_steps,
        settle_steps=args.settle_steps, min_settle_steps=min(3, args.settle_steps), clearance=args.clearance,
        jitter=args.jitter, spread=args.spread, max_displacement=args.max_displacement, max_tilt_deg=args.max_tilt,
        shard_size=args.shard_size, seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        cfg = _config_from_args(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    run_dir = args.out / args.run
    if args.list_tasks:
        suite = _suite(cfg.suite)
        for t in range(suite.n_tasks):
            goal = bddl_goals.parse_goal(_task_problem(suite, t)["goal_state"])
            usable = "movable" if all(p.is_placement for p in goal) else "articulation (skipped by default)"
            print(f"{t}: {suite.get_task(t).language!r} [{usable}] {' '.join(map(str, goal))}")
        return
    if args.summary_only:
        print_summary(summarize(run_dir))
    else:
        generate(cfg, run_dir)
    if args.showcase:
        meta = write_showcase(run_dir, args.out / "showcase", args.showcase)
        print(f"showcase: {len(meta)} held-out frames in {args.out / 'showcase'}")
    if args.export_tfds is not None:
        path = export_tfds(run_dir, args.export_tfds)
        print(f"tfds dataset: {path} (read it with training.memory_data.open_memory_dataset(path, 'train'))")


def _tfds_frames(run_dir: Path, split: str, suite: str) -> Iterator[dict]:
    """A run's frames in `training.memory_data`'s frame format (structured fields as JSON strings)."""
    for f in iter_frames(run_dir, split=split):
        yield {
            "image": f["image"], "wrist_image": f["wrist_image"], "state": f["state"],
            "language_instruction": f["language_instruction"], "memory": f["memory"], "task": f["task_name"],
            "init_index": f["init_index"], "scene": f["scene"], "suite": suite, "task_id": f["task"],
            "frame_key": f["key"], "placed": json.dumps(f["placed"]), "predicates": json.dumps(f["predicates"]),
        }


def export_tfds(run_dir: str | Path, out_dir: str | Path, *, name: str = "libero_memory") -> Path:
    """Convert a run's shards with `training.memory_data.write_memory_dataset` (splits "train", "heldout";
    replaces an earlier export). Returns the dataset version folder."""
    try:
        from training.memory_data import write_memory_dataset
    except ImportError as err:
        raise SystemExit(
            f"--export-tfds needs training.memory_data.write_memory_dataset and its requirements ({err})"
        ) from None
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    rows = _read_jsonl(run_dir / "index.jsonl")
    present = {r["split"] for r in rows}
    splits = {s: _tfds_frames(run_dir, s, config["suite"]) for s in ("train", "heldout") if s in present}
    if not splits:
        raise SystemExit(f"no frames in {run_dir} to export; generate some first")
    return write_memory_dataset(out_dir, splits, image_size=config["image_size"], name=name,
                                jpeg_quality=config["jpeg_quality"], overwrite=True)


if __name__ == "__main__":
    sys.exit(main())
