"""eval.bench and eval.bench.report: grid and CLI handling, and a tiny end-to-end run (JSON, then tables and PNGs)."""

from __future__ import annotations

import json
import math
import re

import pytest

from eval.bench import report
from eval.bench import __main__ as bench_cli
from eval.bench import grid, harness, pi05


# --- grid and command line -----------------------------------------------------------------------


def _grid(*argv):
    return grid.build_grid(bench_cli.parse_args(list(argv)))


def test_paper_grid_keeps_ks_of_the_paper_set_that_divide_n():
    groups = _grid("--grid", "paper")
    assert len(groups) == 3 * 4 * 5  # workloads x S x N
    ks = {g.decode_len: g.ks for g in groups}
    assert ks[30] == (1, 2, 3, 5, 6, 10, 15, 30)
    assert ks[20] == (1, 2, 5, 10)
    assert ks[5] == (1, 5)
    assert {g.arrival for g in groups} == {"uniform:1"}


def test_default_grid_is_the_paper_figures_on_the_bench_preset():
    args = bench_cli.parse_args([])
    assert (args.grid, args.preset, args.frames) == ("figure", "bench", 30)
    groups = grid.build_grid(args)
    assert [g.decode_len for g in groups] == [5, 10, 15, 20, 30]
    assert groups[-1].ks == (1, 2, 3, 5, 10) and groups[0].ks == (5,)
    quick = bench_cli.parse_args(["--quick"])
    assert (quick.grid, quick.preset) == ("quick", "tiny")


def test_explicit_lists_replace_the_grid_and_non_dividing_k_is_kept():
    groups = _grid("--N", "10", "--k", "3", "4", "--S", "5", "--arrival", "poisson:1.5", "burst:4/8")
    assert [(g.num_steps, g.decode_len, g.ks, g.arrival) for g in groups] == [
        (5, 10, (3, 4), "poisson:1.5"), (5, 10, (3, 4), "burst:4/8")]
    assert _grid("--N", "20", "--k", "alldiv")[0].ks == (1, 2, 4, 5, 10, 20)
    assert _grid("--settings", "isolated", "shared_kv")[0].ks == ()  # no continuous, no k


@pytest.mark.parametrize("argv", [
    ["--settings", "baseline"], ["--workloads", "arx"], ["--preset", "huge"], ["--arrival", "poison:1"],
    ["--k", "div", "3"], ["--k", "0"], ["--N", "-1"], ["--slots", "many"], ["--ckpt", "/nonexistent/ckpt"],
    ["--component-batches", "4-2"], ["--preset", "tiny", "--ckpt", "x"],
])
def test_bad_command_lines_exit_with_an_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_cli.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_peak_slots_follow_request_lifetimes():
    one_per_frame = [[30]] * 40
    assert harness.peak_slots(one_per_frame, 5) == 6  # N/k
    assert harness.peak_slots(one_per_frame, 1) == 29  # N - 1: token 0 comes from the prefill
    assert harness.peak_slots([[10] * 4] + [[]] * 7, 5) == 4
    assert harness.peak_slots([[1], [1], [1]], 5) == 1
    assert harness.peak_slots([[]] * 3, 5) == 1


# --- tiny end-to-end run -------------------------------------------------------------------------

_N, _K, _FRAMES = 6, 3, 4


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One bench run: tiny preset, all four settings, bursts of 2 requests every 2 frames; prompts trimmed to a
    16-token bucket, so every setting (continuous batching's pool included) sees the shorter prefix; a rank-2
    language adapter serves half the requests of a second continuous run."""
    out = tmp_path_factory.mktemp("bench")
    bench_cli.main([
        "--preset", "tiny", "--workloads", "libero", "--S", "2", "--N", str(_N), "--k", str(_K),
        "--arrival", "burst:2/2", "--frames", str(_FRAMES), "--warmup", "1", "--component-batches", "1,2",
        "--component-repeats", "2", "--prompt-bucket", "16", "--adapter-rank", "2", "--no-progress", "--out", str(out),
    ])
    return out


def test_bench_writes_summary_components_environment_and_run_files(tiny_run):
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert [(r["setting"], r["k"], r["adapter_share"]) for r in summary] == [
        ("isolated", None, 0), ("parallel", None, 0), ("shared_kv", None, 0), ("continuous", _K, 0),
        ("continuous", _K, 0.5)]
    with_adapter = summary.pop()
    assert with_adapter["adapter_rank"] == 2 and with_adapter["requests_unfinished"] == 0
    assert with_adapter["frames_measured"] == _FRAMES and with_adapter["avg_batch"] == pytest.approx(2.0)
    for r in summary:
        assert set(harness.SUMMARY_KEYS) <= set(r)
        assert (r["workload"], r["preset"], r["S"], r["N"], r["arrival"]) == ("libero", "tiny", 2, _N, "burst:2/2")
        assert r["frames_measured"] == _FRAMES
        assert r["frame_ms_median"] > 0 and r["action_hz"] > 0 and r["tokens_per_s"] > 0
        assert r["compile_s"] > 0 and r["ideal_speedup"] > 0 and r["ideal_frame_ms"] > 0
        assert r["fixed_length_decode"] is True
        assert r["requests_unfinished"] == 0
    iso = summary[0]
    assert iso["speedup_vs_isolated"] == pytest.approx(1.0) and iso["ideal_speedup"] == pytest.approx(1.0)
    cb = summary[3]
    # A burst's 2 requests hold their slots for ceil((N-1)/k) = 2 frames, until the next burst.
    assert cb["k_divides_N"] is True and cb["slots"] == 2 and cb["avg_batch"] == pytest.approx(2.0)
    assert cb["request_latency_frames_mean"] == pytest.approx(math.ceil((_N - 1) / _K))
    assert summary[2]["request_latency_frames_mean"] == 1.0  # shared KV decodes within the arrival frame
    # one slot of the pool continuous batching allocated: K/V, no Qwen3.5 state; the other settings have no pool
    assert cb["slot_bytes"]["kv"] > 0 and set(cb["slot_bytes"]) == {"kv", "total"}  # no carry beside the K/V
    assert cb["slot_bytes"]["total"] > cb["slot_bytes"]["kv"] and iso["slot_bytes"] is None

    comps = json.loads((tiny_run / "components.json").read_text())["libero"]
    assert set(comps["decode_step_ms"]) == {"1", "2"} and set(comps["denoise_ms"]) == {"2"}
    assert set(comps["adapter_step_ms"]) == set(comps["mixed_step_ms"]) == {"1", "2"}
    assert comps["prefill_ms"] > 0

    env = json.loads((tiny_run / "environment.json").read_text())
    for key in ("jax", "jaxlib", "backend", "device_kind", "cpu_count", "dtype", "preset", "commit", "command",
                "timestamp"):
        assert env[key] not in (None, "")
    assert (env["dtype"], env["preset"], env["backend"]) == ("float32", "tiny", "cpu")
    assert env["parameters"] > 0 and len(env["loadavg_start"]) == len(env["loadavg_end"]) == 3  # size and load


def test_run_file_holds_frames_and_requests_of_every_setting(tiny_run):
    run = json.loads((tiny_run / "runs" / "libero_S2_N6_burst-2-2.json").read_text())
    assert run["environment"]["preset"] == "tiny"
    frames, requests = run["frames"], run["requests"]
    warmup = run["config"]["warmup_frames"]
    assert run["config"]["prefix_len"] == 2 * 16 + 16  # two 16-patch cameras + the 16-token prompt bucket
    assert warmup == math.ceil(_N / _K)  # continuous ramp, longer than --warmup 1
    for setting in grid.DEFAULT_SETTINGS:
        mine = [f for f in frames if f["setting"] == setting and "adapter" not in f["label"]]
        assert sum(not f["warmup"] and not f["drain"] for f in mine) == _FRAMES
        assert all(f["frame_ms"] > 0 for f in mine)
        # Bursts: frames alternate between two arrivals and none, in every setting alike.
        assert [f["arrivals"] for f in mine[:4]] == [2, 0, 2, 0]
    assert any(f["drain"] for f in frames if f["setting"] == "continuous")
    end = warmup + _FRAMES  # continuous alone runs the drain frames, with their own arrivals
    by_setting = {s: sorted((q["id"], q["arrival_frame"], q["budget"]) for q in requests
                            if q["setting"] == s and q["arrival_frame"] < end and "adapter" not in q.get("label", ""))
                  for s in grid.DEFAULT_SETTINGS}
    on_adapter = [q["adapter"] for q in requests if "adapter" in q.get("label", "")]
    assert sorted(set(on_adapter)) == [0, 1] and abs(sum(on_adapter) - len(on_adapter) / 2) <= 0.5
    assert all(v == by_setting["isolated"] for v in by_setting.values())  # the same requests everywhere
    assert all(q["tokens"] == _N for q in requests if q["finish_frame"] is not None)  # fixed-length decode
    assert run["compile_s"] and all(v > 0 for v in run["compile_s"].values())


def test_report_writes_tables_and_plots(tiny_run, tmp_path):
    md_path = report.write_report(tiny_run, tmp_path)
    for name in report.PLOTS:
        png = tmp_path / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = md_path.read_text()
    for label in ("isolated", "parallel", "shared KV", f"continuous batching (k={_K})"):
        assert label in md
    assert "## Ablation" in md and "## Component times" in md and "tradeoff.png" in md
    # what the figures are of (size, device, load), and each frame time with its spread over the measured frames
    env = json.loads((tiny_run / "environment.json").read_text())
    assert f"`tiny` preset, random weights, {env['parameters']:,} parameters" in md  # under 1 M: every digit
    assert "cpu backend" in md and "machine load average (1 / 5 / 15 min) at the start" in md
    assert "tiny preset: these figures measure per-call overhead, not the method" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| shared KV |")]
    assert rows and all(re.match(r"\| shared KV \| [\d,.]+ \([\d,.]+–[\d,.]+\) \|", ln) for ln in rows)
    assert "## Language adapter overhead" in md and "half on adapter" in md


# --- several heads on one prefix (--heads) --------------------------------------------------------


@pytest.fixture(scope="module")
def heads_run(tmp_path_factory):
    """Tiny mot model with a GR00T-style head and language (one head keeps the compiles few; `--heads` sums any
    number); isolated (the head its own prefix pass, the text its own) against the fan-out frame, one request per
    frame."""
    out = tmp_path_factory.mktemp("bench_heads")
    bench_cli.main([
        "--heads", "gr00t", "--preset", "tiny", "--image-size", "64", "--workloads", "libero", "--N", "4",
        "--k", "2", "--frames", "3", "--warmup", "1", "--settings", "isolated", "continuous", "--component-batches",
        "1", "--component-repeats", "1", "--no-progress", "--out", str(out),
    ])
    return out


def test_heads_bench_reports_the_fanout_ratio_against_the_single_head_frames_of_the_same_run(heads_run, tmp_path):
    summary = json.loads((heads_run / "summary.json").read_text())
    assert [(r["setting"], r["k"], r["heads"]) for r in summary] == [("isolated", None, ["gr00t"]),
                                                                       ("continuous", 2, ["gr00t"])]
    run = json.loads((heads_run / "runs" / "libero_S0_N4_uniform-1.json").read_text())
    assert run["config"]["prefix_len"] == 2 * (1 + 4 + 1) + 100  # two 64 px cameras (4 tokens each) + the prompt
    iso = [f for f in run["frames"] if f["setting"] == "isolated" and not f["warmup"] and not f["drain"]]
    sums = sorted(sum(f["head_ms"].values()) for f in iso)
    for r in summary:
        assert set(harness.SUMMARY_KEYS) <= set(r)
        assert r["recompiles_after_warmup"] == 0 and r["requests_unfinished"] == 0 and r["frames_measured"] == 3
        assert r["head_steps"] == {"gr00t": 2}  # the head's own (tiny preset)
        assert r["sum_single_head_ms"] == pytest.approx(sums[1])  # median of 3 frames' sums
        assert r["fanout_ratio"] == pytest.approx(r["frame_ms_median"] / sums[1])
        assert r["head_action_hz"]["gr00t"] == pytest.approx(4 * r["action_hz"])  # horizon 4 per chunk
        assert r["single_head_ms"]["gr00t"] == pytest.approx(sorted(f["head_ms"]["gr00t"] for f in iso)[1])
        assert r["tokens_per_s"] > 0
    assert summary[0]["fanout_ratio"] > 1  # isolated also runs the text's own prefix pass
    comps = json.loads((heads_run / "components.json").read_text())["libero"]
    assert set(comps["heads_ms"]) == {"gr00t"} and comps["denoise_ms"] == {}
    md = report.write_report(heads_run, tmp_path).read_text()
    assert "## Fan-out: several heads and language on one prefix" in md and "frame / sum of single-head frames" in md
    assert (tmp_path / report.FANOUT_PLOT).read_bytes()[:4] == b"\x89PNG"


def test_heads_command_lines_are_checked():
    assert bench_cli.parse_args(["--heads", "starvla,xr0"]).heads == ("starvla_qwenpi_v3", "xr0")
    assert bench_cli.parse_args([]).heads is None  # pi0.5, as before
    assert [g.num_steps for g in _grid("--heads", "xr0")] == [0] * 5  # each head's own steps
    for argv in (["--heads", "pi05"], ["--heads", "xr0,xr0"], ["--heads", "xr0", "--preset", "pi05"],
                 ["--heads", "xr0", "--S", "2", "4"]):
        with pytest.raises(SystemExit):
            bench_cli.parse_args(argv)


def test_report_explains_a_missing_summary(tmp_path, capsys):
    with pytest.raises(SystemExit):
        report.main([str(tmp_path)])
    assert "summary.json" in capsys.readouterr().err


def test_checkpoint_option_restores_an_openpi_checkpoint():
    from helpers import openpi_fixture

    args = bench_cli.parse_args(["--ckpt", str(openpi_fixture()), "--dry-run"])
    model, params, preset = pi05.load_model(args, "float32")
    assert preset == "ckpt" and model.cfg.vlm.depth == 3 and model.cfg.vocab_size == 1024
