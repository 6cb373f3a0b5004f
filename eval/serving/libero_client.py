"""Closed-loop LIBERO episodes against the policy server, asking for language while acting.

    python -m oxygen_jax.serve --ckpt /path/to/pi05_libero --robot libero --port 8000      # one shell
    python -m eval.serving.libero_client --port 8000 --suite libero_spatial --tasks 0 1 --episodes 2 --out results/libero

The loop follows openpi's LIBERO example: wait `--wait-steps` with a no-op action while objects settle;
then, whenever the action queue is empty, send the observation (both cameras rotated 180 degrees and
resized with padding to 224 x 224 uint8, state = eef position | axis-angle | 2 gripper positions) and
execute the first `--replan-steps` actions of the returned chunk. Every `--ask-every` model calls the
observation also carries a language request (`--prompt`, default "Subtask: "; `--adapter memory` with
`--prompt "Memory: "` against `python -m oxygen_jax.serve --demo`); its text arrives in a later response and
is overlaid on the video until the next one.

Reports per episode: success, steps, model time (client round trips, and the server's step time) and
simulator time; writes DIR/episodes.json and one video per episode (DIR/<task>_<episode>.gif, or .mp4
with --video-format mp4 when imageio is installed).

The simulator needs LIBERO (requirements-libero.txt, a separate venv); `Env` is the small interface
the loop uses, so a test can run the same loop on a fake environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image, ImageDraw

from oxygen_jax.robots.libero import client_observation
from oxygen_jax.serving import wire

NOOP = np.array([0.0] * 6 + [-1.0])  # openpi's LIBERO dummy action: hold still, gripper open


class Env(Protocol):
    """What the loop needs from a LIBERO environment (robosuite observation keys)."""

    instruction: str

    def reset(self) -> dict: ...

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, dict]: ...


class PolicyClient:
    """A minimal synchronous openpi-protocol client (no openpi-client dependency)."""

    def __init__(self, url: str, open_timeout: float = 60.0):
        from websockets.sync.client import connect

        self._ws = connect(url, compression=None, max_size=None, open_timeout=open_timeout)
        self.metadata = wire.unpack(self._ws.recv())

    def infer(self, obs: dict) -> dict:
        self._ws.send(wire.pack(obs))
        reply = self._ws.recv()
        if isinstance(reply, str):
            raise RuntimeError(f"policy server refused the frame: {reply}")
        return wire.unpack(reply)

    def close(self) -> None:
        self._ws.close()


def overlay(frame: np.ndarray, lines: Sequence[str]) -> np.ndarray:
    """Writes text lines on a dark band at the bottom of an RGB uint8 frame."""
    img = Image.fromarray(frame)
    draw = ImageDraw.Draw(img)
    h = 12 * len(lines) + 4
    draw.rectangle([0, img.height - h, img.width, img.height], fill=(0, 0, 0))
    for i, line in enumerate(lines):
        draw.text((4, img.height - h + 2 + 12 * i), line[:60], fill=(255, 255, 0))
    return np.asarray(img)


@dataclasses.dataclass
class EpisodeResult:
    task: str
    episode: int
    success: bool
    steps: int
    model_calls: int
    model_ms: float  # sum of client round trips
    server_step_ms: float  # sum of the server's Engine.step times for our frames
    sim_ms: float  # sum of env.step times
    texts: list[dict]  # finished language: {"at_step", "id", "text"}
    video: str | None


def run_episode(env: Env, client: PolicyClient, *, task: str, episode: int, max_steps: int, wait_steps: int = 10,
                replan_steps: int = 5, ask_every: int = 2, max_tokens: int = 12, video_dir: Path | None = None,
                video_format: str = "gif", prompt: str = "Subtask: ", adapter: str | None = None) -> EpisodeResult:
    """One closed-loop episode; see the module docstring."""
    raw = env.reset()
    queue: list[np.ndarray] = []
    frames, texts, seen = [], [], set()
    caption = ""
    model_ms = server_ms = sim_ms = 0.0
    calls, success, t = 0, False, 0
    while t < max_steps + wait_steps:
        if t < wait_steps:
            action = NOOP
        else:
            if not queue:
                obs = client_observation(raw, env.instruction)
                if calls % ask_every == 0:
                    request = {"prompt": prompt, "max_tokens": max_tokens, "id": f"{task}-{episode}-{t}"}
                    if adapter:
                        request["adapter"] = adapter
                    obs["language_requests"] = [request]
                start = time.perf_counter()
                reply = client.infer(obs)
                model_ms += (time.perf_counter() - start) * 1e3
                server_ms += reply.get("server_timing", {}).get("infer_ms", 0.0)
                calls += 1
                queue = list(np.asarray(reply["actions"])[:replan_steps])
                for done in reply.get("language", {}).get("finished", []):
                    if done["id"] not in seen:  # delivered once, but be safe
                        seen.add(done["id"])
                        texts.append({"at_step": t, "id": done["id"], "text": done["text"]})
                        caption = done["text"]
            action = queue.pop(0)
        start = time.perf_counter()
        raw, _, done_flag, _ = env.step(np.asarray(action, np.float64))
        sim_ms += (time.perf_counter() - start) * 1e3
        if video_dir is not None:
            frames.append(overlay(np.ascontiguousarray(raw["agentview_image"][::-1, ::-1]).astype(np.uint8),
                                  [env.instruction, f"step {t}  text: {caption}"]))
        t += 1
        if done_flag:
            success = True
            break
    video = None
    if video_dir is not None and frames:
        video = str(_write_video(video_dir / f"{task}_{episode}.{video_format}", frames))
    return EpisodeResult(task=task, episode=episode, success=success, steps=t, model_calls=calls, model_ms=model_ms,
                         server_step_ms=server_ms, sim_ms=sim_ms, texts=texts, video=video)


def _write_video(path: Path, frames: list[np.ndarray], fps: int = 10) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".mp4":
        import imageio  # optional: imageio + imageio-ffmpeg

        imageio.mimwrite(path, frames, fps=fps)
        return path
    images = [Image.fromarray(f) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    return path


class LiberoEnv:
    """A LIBERO task in robosuite's off-screen renderer (needs requirements-libero.txt)."""

    def __init__(self, suite: str, task_id: int, resolution: int = 256, seed: int = 0):
        import os

        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        self._suite = benchmark.get_benchmark_dict()[suite]()
        task = self._suite.get_task(task_id)
        self.instruction, self.name = task.language, task.name
        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        self._env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=resolution, camera_widths=resolution)
        self._env.seed(seed)
        self._init_states = self._suite.get_task_init_states(task_id)
        self._episode = 0

    def reset(self) -> dict:
        self._env.reset()
        obs = self._env.set_init_state(self._init_states[self._episode % len(self._init_states)])
        self._episode += 1
        return obs

    def step(self, action):
        return self._env.step(action.tolist())


_MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.serving.libero_client", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--suite", default="libero_spatial", choices=sorted(_MAX_STEPS))
    ap.add_argument("--tasks", type=int, nargs="+", default=[0])
    ap.add_argument("--episodes", type=int, default=1, help="episodes per task")
    ap.add_argument("--max-steps", type=int, help="default: openpi's per-suite limit")
    ap.add_argument("--replan-steps", type=int, default=5)
    ap.add_argument("--ask-every", type=int, default=2, help="a language request every N model calls")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--prompt", default="Subtask: ", help="language request prompt (e.g. 'Memory: ')")
    ap.add_argument("--adapter", default=None, help="language adapter name the server serves (e.g. memory)")
    ap.add_argument("--video-format", default="gif", choices=["gif", "mp4"])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    client = PolicyClient(f"ws://{args.host}:{args.port}")
    results = []
    try:
        for task_id in args.tasks:
            env = LiberoEnv(args.suite, task_id)
            for ep in range(args.episodes):
                res = run_episode(env, client, task=f"{args.suite}_{task_id}", episode=ep,
                                  max_steps=args.max_steps or _MAX_STEPS[args.suite], replan_steps=args.replan_steps,
                                  ask_every=args.ask_every, max_tokens=args.max_tokens, video_dir=args.out,
                                  video_format=args.video_format, prompt=args.prompt, adapter=args.adapter)
                results.append(dataclasses.asdict(res))
                print(f"{res.task} episode {ep}: {'success' if res.success else 'failure'} in {res.steps} steps; "
                      f"model {res.model_ms / max(res.model_calls, 1):.0f} ms/call x {res.model_calls}, "
                      f"simulator {res.sim_ms / max(res.steps, 1):.1f} ms/step; {len(res.texts)} texts", flush=True)
    finally:
        client.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "episodes.json").write_text(json.dumps(results, indent=1))
    print(f"success rate {np.mean([r['success'] for r in results]):.2f} over {len(results)} episodes; "
          f"wrote {args.out / 'episodes.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
