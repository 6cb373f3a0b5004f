"""The simulator side: one LIBERO task's scene (`TaskScene`) and one placed, settled, checked frame (`make_frame`).

Needs the simulator venv (`training.data.libero`'s docstring); mujoco and LIBERO are imported when a scene is built.
"""

from __future__ import annotations

import collections
import hashlib
import os
import time
from collections.abc import Sequence

import numpy as np

from oxygen_jax.robots.libero import camera_images, eef_state
from training.data.libero import bddl_goals
from training.data.libero.config import RESET_BASE, GenConfig

_NOOP = np.array([0, 0, 0, 0, 0, 0, -1.0])  # zero delta pose, gripper open (openpi's LIBERO wait action)
_PARK_Z = 5.0  # objects being placed wait this high, out of the way of the drop-height rays
_RAY_START_Z = 3.0


class TaskScene:
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
        return camera_images(obs), eef_state(obs).astype(np.float32)

    def close(self):
        self.env.close()


def _tilt_deg(rot_a: np.ndarray, rot_b: np.ndarray) -> float:
    """Angle between the body z axes of two rotations [3, 3] (yaw does not count)."""
    return float(np.degrees(np.arccos(np.clip(rot_a[:, 2] @ rot_b[:, 2], -1.0, 1.0))))


def _rotation_deg(rot_a: np.ndarray, rot_b: np.ndarray) -> float:
    """Angle of the rotation between two rotations [3, 3]."""
    return float(np.degrees(np.arccos(np.clip((np.trace(rot_a.T @ rot_b) - 1.0) / 2.0, -1.0, 1.0))))


def make_frame(scene: TaskScene, snapshot: np.ndarray, subset: Sequence[int], rng: np.random.Generator) -> dict:
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

