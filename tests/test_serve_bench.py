"""The serving benchmark and the closed-loop LIBERO client, against a model-free server (no compile)."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest
from PIL import Image

from eval.serving import libero_client, serve_bench, serve_bench_hostile
from oxygen_jax.robots.libero import quat_to_axis_angle
from oxygen_jax.serving.codec import frame_noise
from oxygen_jax.serving.server import PolicyServer, ServeConfig, ServerThread
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from test_serve import ROBOT, ScriptedEngine

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


@pytest.fixture(scope="module")
def server():
    engine = ScriptedEngine(step_s=0.004, per_row_s=0.001)
    handle = ServerThread(PolicyServer(engine, train_demo_tokenizer(), ROBOT, ServeConfig(
        host="127.0.0.1", port=0, buckets=(1, 2, 4)))).start()
    handle.wait_ready(timeout=60)
    yield handle
    handle.stop()


def test_lock_step_robots_are_measured_and_summarised(server):
    run = serve_bench.run_robots(f"ws://127.0.0.1:{server.port}", robots=2, frames=6, warmup_frames=1, max_tokens=3,
                                 max_live=1)
    assert run["errors"] == [] and run["action_horizon"] == ROBOT.action_horizon
    assert sorted(f["robot"] for f in run["frames"]) == [0] * 6 + [1] * 6
    assert all(f["rtt_ms"] >= f["step_ms"] > 0 for f in run["frames"])
    # The scripted engine finishes a request in the step that admits it: one per measured frame, 3 tokens.
    assert len(run["finished"]) == 12 and all(f["tokens"] == 3 for f in run["finished"])

    rec = serve_bench.summarize("batched", 2, [run])
    assert set(serve_bench.SUMMARY_KEYS) <= set(rec)
    assert rec["frames"] == rec["requests_finished"] == 12
    spans = [max(f["t_recv"] for f in run["frames"] if f["robot"] == r) -
             min(f["t_recv"] for f in run["frames"] if f["robot"] == r) for r in (0, 1)]
    # 5 chunks after each robot's first reply, over its own span; tokens of the requests finished in the spans.
    assert rec["action_rate_total"] == pytest.approx(sum(5 * ROBOT.action_horizon / s for s in spans))
    assert rec["action_rate_per_robot"] == pytest.approx(rec["action_rate_total"] / 2)
    assert rec["tokens_per_s"] == pytest.approx(2 * 5 * 3 / np.mean(spans)) and 1 <= rec["mean_batch"] <= 2

    pooled = serve_bench.summarize("batched", 2, [run, run])  # repeats pool chunks and spans
    assert pooled["frames"] == 24 and pooled["action_rate_total"] == pytest.approx(rec["action_rate_total"])
    with pytest.raises(ValueError, match="at least 2"):
        serve_bench.summarize("batched", 3, [run])  # robot 2 never ran


def _record(mode, robots, rate, step_ms_by_bucket, ha=10):
    return {"mode": mode, "robots": robots, "action_rate_total": rate, "action_horizon": ha,
            "step_ms_by_bucket": {str(b): ms for b, ms in step_ms_by_bucket.items()},
            "ideal_action_rate_total": float("nan"), "fraction_of_ideal": float("nan"),
            "speedup_vs_serial": float("nan")}


def test_hostile_bench_frames_are_all_refused_and_its_robot_is_measured(server):
    url = f"ws://127.0.0.1:{server.port}"
    assert len(serve_bench_hostile.robot_rtts(url, frames=3, warmup=1)) == 3
    ws = serve_bench_hostile._connect(url)
    ws.recv()
    # What the attackers of the RTT measurement send; the last (too many prompt tokens) needs the engine's
    # tokenizer, which the scripted engine lacks (test_hostile refuses it on a real engine).
    for frame in serve_bench_hostile.hostile_frames()[:-1]:
        ws.send(frame)
        assert ws.recv(timeout=30).startswith("BadRequest: ")
    ws.close()
    assert serve_bench_hostile.rss_mb(os.getpid()) > 0


def test_ideal_rate_comes_from_the_runs_own_step_times():
    batched = _record("batched", 4, 800.0, {2: 30.0, 4: 40.0})  # ideal: 4 chunks of 10 per 40 ms step
    serial = _record("serial", 4, 400.0, {1: 20.0})  # ideal: one chunk of 10 per 20 ms step
    lone = _record("batched", 8, 100.0, {4: 40.0})  # no step held all 8 robots: no ideal
    serve_bench.compare([batched, serial, lone])
    assert batched["ideal_action_rate_total"] == pytest.approx(1000.0) and batched["fraction_of_ideal"] == 0.8
    assert serial["ideal_action_rate_total"] == pytest.approx(500.0) and serial["fraction_of_ideal"] == 0.8
    assert batched["speedup_vs_serial"] == 2.0
    assert lone["ideal_action_rate_total"] != lone["ideal_action_rate_total"]  # NaN


def test_report_files_and_server_commands(server, tmp_path):
    run = serve_bench.run_robots(f"ws://127.0.0.1:{server.port}", robots=1, frames=3, warmup_frames=0)
    records = serve_bench.compare([serve_bench.summarize("batched", 1, [run])])
    args = argparse.Namespace(preset="tiny", ckpt=None, robots=[1, 4], steps=2, slots=8, max_tokens=4,
                              tokens_per_frame=2, prompt_len=32, dtype="float32", compile_cache="none")
    cmd = serve_bench.server_command(args, "batched", 1234)
    assert cmd[1:3] == ["-m", "oxygen_jax.serve"] and cmd[cmd.index("--batch-sizes") + 1] == "1,2,4"
    assert serve_bench.server_command(args, "serial", 1234)[cmd.index("--batch-sizes") + 1] == "1"
    meta = {"preset": "tiny", "command": "python -m eval.serving.serve_bench", "server_commands": {"batched": " ".join(cmd)},
            "startup_s": {"batched": 1.0}}
    serve_bench.write_report(tmp_path, records, meta)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["records"][0]["robots"] == 1 and summary["environment"]["preset"] == "tiny"
    report = (tmp_path / "report.md").read_text()
    assert "| batched | 1 |" in report and "oxygen_jax.serve" in report
    assert (tmp_path / "serve_bench.png").stat().st_size > 10_000


class FakeLiberoEnv:
    """robosuite-shaped observations with random pixels; succeeds after `success_at` steps; records actions."""

    instruction = "put the bowl on the plate"

    def __init__(self, success_at: int):
        self.success_at, self.actions, self._rng = success_at, [], np.random.default_rng(0)

    def _raw(self) -> dict:
        return {"agentview_image": self._rng.integers(0, 256, (128, 128, 3), dtype=np.uint8),
                "robot0_eye_in_hand_image": self._rng.integers(0, 256, (128, 128, 3), dtype=np.uint8),
                "robot0_eef_pos": self._rng.standard_normal(3), "robot0_eef_quat": np.array([0.0, 0.0, 0.0, 1.0]),
                "robot0_gripper_qpos": np.array([0.04, -0.04])}

    def reset(self) -> dict:
        self.actions = []
        return self._raw()

    def step(self, action):
        self.actions.append(np.asarray(action))
        return self._raw(), 0.0, len(self.actions) >= self.success_at, {}


def test_libero_client_closes_the_loop_asks_for_language_and_writes_a_captioned_video(server, tmp_path):
    env = FakeLiberoEnv(success_at=25)
    client = libero_client.PolicyClient(f"ws://127.0.0.1:{server.port}")
    res = libero_client.run_episode(env, client, task="fake", episode=0, max_steps=40, wait_steps=3, replan_steps=5,
                                    ask_every=2, max_tokens=3, video_dir=tmp_path)
    client.close()
    assert res.success and res.steps == 25 and res.model_calls == 5  # 22 acting steps / 5 per call
    np.testing.assert_array_equal(np.stack(env.actions[:3]), np.stack([libero_client.NOOP] * 3))
    stream = client.metadata["stream"]
    for call in range(res.model_calls):  # the executed actions are the first 5 of each served chunk
        chunk = frame_noise(0, stream, call, ROBOT.action_horizon, 32)[:5, :7]
        executed = np.stack(env.actions[3 + 5 * call: 8 + 5 * call])
        np.testing.assert_array_equal(executed, chunk[: len(executed)])
    # Requests at calls 0, 2, 4; the scripted engine answers with the reversed prompt.
    assert [t["text"] for t in res.texts] == [" :ksatbuS"] * 3 and len({t["id"] for t in res.texts}) == 3
    assert res.model_ms > 0 and res.server_step_ms > 0 and res.sim_ms >= 0
    video = Image.open(res.video)
    assert video.n_frames == 25
    video.seek(24)
    band = np.asarray(video.convert("RGB"))[-10:]
    assert (band == 0).all(axis=-1).mean() > 0.5  # the caption band is drawn


def test_axis_angle_matches_a_known_rotation():
    half = np.pi / 4  # 90 degrees about z
    np.testing.assert_allclose(quat_to_axis_angle(np.array([0, 0, np.sin(half), np.cos(half)])),
                               [0, 0, np.pi / 2], atol=1e-12)
    np.testing.assert_array_equal(quat_to_axis_angle(np.array([0.0, 0, 0, 1])), np.zeros(3))
