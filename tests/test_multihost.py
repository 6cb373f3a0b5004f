"""Multi-process data parallelism on localhost (CPU, gloo collectives), as `jax.distributed` runs it on hosts:
N processes train the run one process with N simulated devices trains (bit for bit with the fixed-order
reduction), each decoding only its rows; process 0 alone writes the adapter and the logs; a run stopped on
2 processes resumes on 1 or 4; a killed process takes the others down within seconds; the flow-matching step on
2 processes equals 2 simulated devices.

Workers are subprocesses started together (`_workers`) on a free port; the suite's XLA flags (tests/conftest.py)
are inherited, so every program is compiled the way the reference's is. The 4-process resume and the flow-matching
step run with OXYGEN_JAX_MULTIHOST_FULL=1 (`FULL`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import jax
import numpy as np
import pytest

from helpers import REPO, save_base
from oxygen_jax.ckpts import own
from oxygen_jax.ckpts.adapters import load_adapter
from oxygen_jax.models.pi05.params import for_backend
from training import distributed
from training.data.frames import write_memory_dataset
from training.data.synthetic_memory import SyntheticMemoryConfig, synthetic_splits

# The suite runs the 2-process cases of the CLI and the kill test; OXYGEN_JAX_MULTIHOST_FULL=1 adds the 4-process
# resume and the flow-matching step (about 100 s more on 2 cores: every worker compiles its own program).
FULL = pytest.mark.skipif(os.environ.get("OXYGEN_JAX_MULTIHOST_FULL") != "1",
                          reason="4-process resume and flow-matching: set OXYGEN_JAX_MULTIHOST_FULL=1 (~100 s)")
STEPS, BATCH = 3, 4
PEAK_LR = 2e-2
# 3 adapter steps on the tiny preset, checkpoints after steps 2 and 3, no evaluation (its split is tested apart).
FLAGS = ["--steps", str(STEPS), "--batch-size", str(BATCH), "--suffix-len", "40", "--prompt-len", "48", "--rank", "2",
         "--lr", str(PEAK_LR), "--warmup", "1", "--checkpoint-every", "2", "--eval-split", "", "--no-progress",
         "--fixed-order-reduction", "--heartbeat-timeout", "10"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))


def _start(argv: list[str], devices: int = 1) -> subprocess.Popen:
    """A worker whose stdout is a pipe and whose stderr goes to a temporary file (`_stderr`)."""
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=_env(devices), stdout=subprocess.PIPE, stderr=err,
                            text=True)
    proc.err_file = err
    return proc


def _stderr(p: subprocess.Popen) -> str:
    p.err_file.seek(0)
    return p.err_file.read()


def _workers(n: int, argv: list[str]) -> list[subprocess.Popen]:
    """`python argv --coordinator localhost:PORT --num-processes n --process-id i` for i < n, started at once."""
    port = _free_port()
    return [_start([*argv, "--coordinator", f"localhost:{port}", "--num-processes", str(n), "--process-id", str(i)])
            for i in range(n)]


def _finish(procs, timeout: float = 400) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each process, in order."""
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout, _stderr(p)))
    return out


def _ok(results) -> None:
    for i, (rc, out, err) in enumerate(results):
        assert rc == 0, f"process {i} exited {rc}: {err[-2500:]}"


def _decoded(out: str) -> int:
    line = next(x for x in out.splitlines() if "training frames" in x)
    return int(line.split("decoded ")[1].split()[0])


def _adapter_digests(out_dir) -> dict:
    return {k: v["sha256"] for k, v in json.loads((out_dir / "adapter" / "adapter.json").read_text())["leaves"].items()}


def _events(out_dir, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_params):
    """(dataset: 16 train / 8 held-out synthetic frames at 56 px, a saved tiny base)."""
    root = tmp_path_factory.mktemp("multihost")
    frames = synthetic_splits(SyntheticMemoryConfig(image_size=56, num_inits=6, num_train_inits=4))
    data = write_memory_dataset(root / "data", frames, image_size=56, name="synthetic_memory")
    base = save_base(root / "base", for_backend(tiny_params))
    return data, base


def _cli(inputs, out) -> list[str]:
    data, base = inputs
    return ["-m", "training.memory", "--base", str(base), "--data", str(data), "--out", str(out), *FLAGS]


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory):
    """The reference (1 process, 2 simulated devices) and the same run on 2 processes × 1 device, side by side."""
    root = tmp_path_factory.mktemp("runs")
    two = _workers(2, _cli(inputs, root / "two"))
    one = _start(_cli(inputs, root / "one"), devices=2)
    results = _finish([*two, one])
    _ok(results)
    return root, results[:2], results[2]


def test_two_processes_train_the_two_device_adapter_bit_for_bit_each_decoding_its_rows(runs):
    root, two, one = runs
    assert _adapter_digests(root / "two") == _adapter_digests(root / "one")  # every leaf, bit for bit
    assert sorted(p.name for p in (root / "two").iterdir() if "adapter" in p.name) == ["adapter"]
    assert [_decoded(out) for _, out, _ in two] == [STEPS * BATCH // 2] * 2  # B/N frames per step each
    assert _decoded(one[1]) == STEPS * BATCH
    # process 0 alone logs and saves: the one-process run's log lines, none twice
    def lines(run):
        return [{k: v for k, v in e.items() if k != "s_per_step"}
                for e in map(json.loads, (root / run / "metrics.jsonl").read_text().splitlines())]

    assert lines("two") == lines("one")
    assert "saved" not in two[1][1] and "saved" in two[0][1]


def test_evaluation_split_over_processes_judges_every_frame_once_and_sums_to_the_whole(monkeypatch):
    """`exact_match_hits` parts (i, n): batch k goes to process k mod n; the parts' sums are the one-process result."""
    from training.memory import evaluate

    frames = [{"memory": f"m{i}", "id": i} for i in range(11)]
    seen = []

    def answers(params, task, batches, **kw):  # "answers" right for even frame ids, batches of 3 rows
        ids = [f for b in batches for f in b]
        seen.extend(ids)
        return evaluate.EngineAnswers(texts=[f"m{i}" if i % 2 == 0 else "x" for i in ids], tokens=[], actions=None)

    monkeypatch.setattr(evaluate, "engine_answers", answers)
    monkeypatch.setattr(evaluate, "fixed_batches", lambda fr, task, cfg, b: [[f["id"] for f in fr]])
    params = type("P", (), {"config": None})()
    task = type("T", (), {"label_key": "memory"})()
    whole = evaluate.exact_match_hits(params, task, frames, batch_size=3)
    for n in (2, 3, 4):
        seen.clear()
        parts = [evaluate.exact_match_hits(params, task, frames, batch_size=3, part=(i, n)) for i in range(n)]
        assert sorted(seen) == list(range(11))  # every frame judged by exactly one process
        assert tuple(map(sum, zip(*parts))) == whole == (6, 11)


def test_fsdp_splits_the_largest_divisible_axis_of_leaves_at_or_above_the_threshold():
    from jax.sharding import PartitionSpec as P

    from training.distributed import fsdp_spec

    assert fsdp_spec((4, 128, 512), 2, 1024) == P(None, None, "data")
    assert fsdp_spec((6, 128, 10), 4, 1024) == P(None, "data", None)  # 6 and 10 do not split over 4
    assert fsdp_spec((512,), 2, 513) == P()  # below the threshold
    assert fsdp_spec((3, 5), 2, 1) == P()  # nothing divisible
    assert fsdp_spec((), 2, 1) == P() and fsdp_spec((4, 4), 2, None) == P() and fsdp_spec((8, 8), 1, 1) == P()


def _stopped_after_2(root, name):
    """A copy of the 2-process run as if killed after step 2: its step-3 checkpoint and adapter removed."""
    dest = root / name
    shutil.copytree(root / "two", dest)
    shutil.rmtree(dest / "checkpoints" / str(STEPS))
    shutil.rmtree(dest / "adapter")
    return dest


def test_a_run_stopped_on_two_processes_resumes_on_one_process_bit_for_bit(runs, inputs):
    root, _, _ = runs
    out = _stopped_after_2(root, "on_one")
    _ok(_finish([_start(_cli(inputs, out), devices=2)]))
    assert [e["step"] for e in _events(out, "resumed")] == [2]
    assert _adapter_digests(out) == _adapter_digests(root / "one")  # the straight run's adapter (same 2 devices)


@FULL
def test_a_run_stopped_on_two_processes_resumes_on_four_within_adams_bound(runs, inputs):
    root, _, _ = runs
    out = _stopped_after_2(root, "on_four")
    results = _finish(_workers(4, _cli(inputs, out)))
    _ok(results)
    assert [e["step"] for e in _events(out, "resumed")] == [2]
    assert [_decoded(o) for _, o, _ in results] == [BATCH // 4] * 4
    # Both continue the same step-2 state; only step 3's gradient sums differ (2 vs 4 shards), in float32 rounding.
    # Adam's bias-corrected update |m̂ / √v̂| is at most 1.01 at step 3 (b1 0.9, b2 0.95; Cauchy-Schwarz over the
    # moments' weights), so an element whose near-zero gradient flips sign moves by at most ~2 lr <= 2 × the peak
    # (3 × allowed); all others agree to rounding (median far below a step).
    cfg = own.stored_config(inputs[1])
    a, b = (load_adapter(d / "adapter", cfg, base=inputs[1])[0] for d in (out, root / "one"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        diff = np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))
        assert diff.max() <= 3 * PEAK_LR and np.median(diff) < 1e-4 * PEAK_LR


_HEARTBEAT = textwrap.dedent("""
    import sys, time
    from training import distributed
    i = sys.argv.index("--coordinator")
    distributed.initialize(distributed.DistributedConfig(coordinator=sys.argv[i + 1], num_processes=int(sys.argv[i + 3]),
                                                         process_id=int(sys.argv[i + 5])))  # the default heartbeat
    import jax, numpy as np
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), (distributed.DATA,))
    x = distributed.global_batch(np.ones((1, 4), np.float32), mesh, jax.device_count())
    total = jax.jit(lambda x: x.sum(), out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    while True:  # collectives forever, until a peer dies
        total(x).block_until_ready()
        print("alive", flush=True)
        time.sleep(0.2)
""")


def test_killing_one_process_makes_every_other_exit_non_zero_within_30_s_by_default():
    procs = _workers(2, ["-c", _HEARTBEAT])
    try:
        lines = iter(procs[1].stdout.readline, "")  # until process 1 runs collectives with process 0 (gloo talks first)
        assert any(line.strip() == "alive" for line in lines), _stderr(procs[1])[-2000:]
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        codes = [p.wait(timeout=30) for p in procs[:1]]
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert all(c != 0 for c in codes), codes
    assert elapsed < 30


_FLOW = textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    from training import distributed
    argv = sys.argv[2:]
    if "--coordinator" in argv:
        i = argv.index("--coordinator")
        distributed.initialize(distributed.DistributedConfig(coordinator=argv[i + 1], num_processes=int(argv[i + 3]),
                                                             process_id=int(argv[i + 5])))
    import jax, numpy as np
    from helpers import make_obs
    from oxygen_jax.models.pi05.config import model_config
    from oxygen_jax.models.pi05.params import init_params
    from training.memory.model import make_mesh
    from training.flow.train_step import OptimizerConfig, init_train_state, make_optimizer, make_sharded_train_step
    params = init_params(model_config("tiny"), 0)
    mesh = make_mesh()
    step, state = make_sharded_train_step(mesh, init_train_state(params, make_optimizer(OptimizerConfig(
        peak_lr=3e-3, warmup_steps=1, decay_steps=10))), fsdp_min_size=4096)
    B = 2
    obs = jax.tree.map(np.asarray, make_obs(params.config, batch=B))
    actions = np.random.default_rng(0).uniform(-1, 1, (B, 4, 32)).astype(np.float32)
    start, stop = distributed.process_rows(mesh, B)  # this process's rows only
    obs, actions = distributed.global_batch((jax.tree.map(lambda x: x[start:stop], obs), actions[start:stop]), mesh, B)
    losses = []
    for s in range(2):
        state, m = step(state, jax.random.fold_in(jax.random.key(0), s), obs, actions)
        losses.append(float(m["loss"]))
    leaves = distributed.host(jax.tree.leaves(state.params))
    if distributed.is_primary():
        np.savez(sys.argv[1], losses=np.asarray(losses), *leaves)
""")


@FULL
def test_the_flow_matching_step_on_two_processes_equals_two_simulated_devices(tmp_path):
    two = _workers(2, ["-c", _FLOW, str(tmp_path / "two.npz")])
    one = _start(["-c", _FLOW, str(tmp_path / "one.npz")], devices=2)
    _ok(_finish([*two, one]))
    a, b = np.load(tmp_path / "two.npz"), np.load(tmp_path / "one.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) > 10
    for name in a.files:  # two devices: a two-term all-reduce is the same sum in either order
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert a["losses"][1] != a["losses"][0]  # the step moved the parameters


@pytest.mark.parametrize("given, message", [
    (dict(coordinator="nohostport", num_processes=2, process_id=0), "must be HOST:PORT"),
    (dict(coordinator="host:70000", num_processes=2, process_id=0), "must be HOST:PORT"),
    (dict(coordinator="host:1234", num_processes=2, process_id=2), r"process_id must be in \[0, 2\)"),
    (dict(coordinator="host:1234"), "together"),
])
def test_a_bad_distributed_setting_is_refused_in_one_line_before_any_connection(given, message):
    with pytest.raises(ValueError, match=message):
        distributed.DistributedConfig(**given)


def test_two_processes_given_different_data_refuse_in_one_line_before_anything_loads(inputs, tmp_path):
    """The data digests differ (another label): both processes exit 2 in one line, within 60 s, --out empty."""
    data, base = inputs
    frames = synthetic_splits(SyntheticMemoryConfig(image_size=56, num_inits=6, num_train_inits=4))
    frames["train"][0] = {**frames["train"][0], "memory": frames["train"][0]["memory"] + " Also the lid."}
    other = write_memory_dataset(tmp_path / "other", frames, image_size=56, name="synthetic_memory")
    port = _free_port()
    t0 = time.monotonic()
    procs = [_start(["-m", "training.memory", "--base", str(base), "--data", str(d), "--out", str(tmp_path / "out"),
                     *FLAGS, "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)])
             for i, d in enumerate((data, other))]
    results = _finish(procs, timeout=120)
    assert time.monotonic() - t0 < 60
    for rc, _, err in results:
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and "the data (--data: its files, splits and labels) differs between " \
            "processes: process 1 has another than process 0" in lines[0], err[-2000:]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_an_unreachable_coordinator_is_refused_in_one_line_within_the_init_timeout(tmp_path, capsys):
    from training.memory.__main__ import main

    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    code = main(["--data", str(tmp_path), "--out", str(tmp_path / "out"), "--coordinator", f"127.0.0.1:{port}",
                 "--num-processes", "2", "--process-id", "1", "--init-timeout", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and time.monotonic() - t0 < 10
    assert f"cannot reach the coordinator 127.0.0.1:{port} within 1 s" in err, err
