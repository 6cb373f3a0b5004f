"""Benchmark metrics and arrival patterns on synthetic records (no model, no timing)."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

from eval.bench import arrivals, metrics


def _frames(ms, tokens=None, warmup=0, drain=0, batch=None, setting="continuous"):
    n = len(ms)
    tokens = tokens or [0] * n
    batch = batch or [1] * n
    return [
        {"frame": f, "setting": setting, "frame_ms": float(ms[f]), "tokens": tokens[f], "batch": batch[f],
         "arrivals": 1, "decode_steps": 1, "warmup": f < warmup, "drain": f >= n - drain}
        for f in range(n)
    ]


def _request(rid, arrival, finish, tokens=5):
    return {"id": rid, "setting": "continuous", "arrival_frame": arrival, "admit_frame": arrival,
            "finish_frame": finish, "tokens": tokens, "budget": tokens}


# --- frame statistics ----------------------------------------------------------------------------


def test_percentile_interpolates_between_order_statistics():
    assert metrics.percentile([1, 2, 3, 4], 50) == 2.5
    assert metrics.percentile(range(101), 90) == 90.0
    assert metrics.percentile([7.0], 99) == 7.0
    assert math.isnan(metrics.percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        metrics.percentile([1.0], 101)


def test_rates_are_ratios_of_sums_over_measured_frames():
    # Worked example of the module docstring, behind one warm-up frame that must not count.
    frames = _frames([1000, 100, 100, 200], tokens=[99, 5, 5, 10], warmup=1)
    assert metrics.action_hz(frames, 10) == pytest.approx(75.0)
    assert metrics.tokens_per_s(frames) == pytest.approx(50.0)
    assert metrics.tokens_per_frame(frames) == pytest.approx(20 / 3)
    # Ratio of sums, not a mean of per-frame rates (which would say 50 tokens/s here).
    uneven = _frames([100, 300], tokens=[10, 0])
    assert metrics.tokens_per_s(uneven) == pytest.approx(25.0)


def test_warmup_and_drain_frames_are_excluded_from_latency_statistics():
    frames = _frames([500, 10, 20, 30, 40, 900], warmup=1, drain=1)
    lat = metrics.frame_latency(frames)
    assert lat["n"] == 4
    assert lat["mean"] == pytest.approx(25.0)
    assert lat["median"] == pytest.approx(25.0)
    assert lat["max"] == 40.0
    assert lat["p99"] == pytest.approx(metrics.percentile([10, 20, 30, 40], 99))


def test_average_batch_counts_empty_frames_as_zero():
    frames = _frames([10, 10, 10, 10], batch=[7, 2, 0, 4], warmup=1)
    assert metrics.average_batch(frames) == pytest.approx(2.0)


def test_no_measured_frames_gives_nan_not_an_error():
    frames = _frames([10, 10], warmup=2)
    assert metrics.frame_latency(frames)["n"] == 0
    assert math.isnan(metrics.action_hz(frames, 10))
    assert math.isnan(metrics.tokens_per_s(frames))


def test_speedup_is_the_ratio_of_mean_frame_times():
    iso = _frames([40, 40, 40], setting="isolated")
    cb = _frames([10, 20, 30], setting="continuous")
    assert metrics.speedup(iso, cb) == pytest.approx(2.0)


# --- request latency -----------------------------------------------------------------------------


def test_request_latency_runs_from_arrival_tick_to_end_of_finishing_frame():
    frames = _frames([100, 100, 200, 50])
    done = metrics.request_latencies([_request(0, 1, 2)], frames)
    assert done[0]["latency_frames"] == 2
    assert done[0]["latency_ms"] == pytest.approx(300.0)  # frames 1 and 2, not just the finishing frame
    same = metrics.request_latencies([_request(1, 3, 3)], frames)
    assert same[0]["latency_frames"] == 1 and same[0]["latency_ms"] == pytest.approx(50.0)


def test_request_latency_excludes_warmup_arrivals_and_counts_unfinished():
    frames = _frames([10, 20, 30, 40, 50, 60], warmup=2, drain=1)
    reqs = [
        _request(0, 0, 3),  # arrived during warm-up: excluded even though it finished while measuring
        _request(1, 2, 5),  # finishes in the drain frame: counted, the drain frame's time included
        _request(2, 3, 3),
        _request(3, 4, None),  # still running at the end
        _request(4, 5, 5),  # arrived in the drain frame: not a measured arrival
    ]
    stats = metrics.request_latency(reqs, frames)
    assert stats["n"] == 2 and stats["unfinished"] == 1
    assert stats["frames_mean"] == pytest.approx((4 + 1) / 2)
    assert stats["ms_mean"] == pytest.approx(((30 + 40 + 50 + 60) + 40) / 2)
    assert stats["frames_max"] == 4.0


def test_request_latency_rejects_inconsistent_records():
    frames = _frames([10, 10, 10])
    with pytest.raises(ValueError, match="precedes"):
        metrics.request_latencies([_request(0, 2, 1)], frames)
    with pytest.raises(ValueError, match="no frame records"):
        metrics.request_latencies([_request(0, 1, 7)], frames)


# --- components and ideal frame times ------------------------------------------------------------

_COMP = metrics.Components(prefill_ms=10.0, denoise_ms={10: 5.0}, decode_step_ms={1: 1.0, 2: 1.5, 4: 2.0})


def test_decode_step_time_interpolates_and_extrapolates():
    assert _COMP.decode_step(0) == 0.0
    assert _COMP.decode_step(1) == 1.0
    assert _COMP.decode_step(3) == pytest.approx(1.75)
    assert _COMP.decode_step(6) == pytest.approx(2.5)  # slope of the last two points
    assert _COMP.denoise(20) == pytest.approx(10.0)  # scaled from the per-step time
    assert _COMP.denoise_step() == pytest.approx(0.5)


def test_components_round_trip_through_json():
    again = metrics.Components.from_json(_COMP.to_json())
    assert again == _COMP


def test_steady_state_ideal_frames_follow_section_8_4():
    # N = 30: 29 decode forwards per request (token 0 comes from the prefill logits).
    kw = dict(num_steps=10, decode_len=30, tokens_per_frame=5)
    assert metrics.steady_state_ideal_ms("isolated", _COMP, **kw) == pytest.approx(2 * 10 + 5 + 29 * 1)
    assert metrics.steady_state_ideal_ms("shared_kv", _COMP, **kw) == pytest.approx(10 + 5 + 29)
    assert metrics.steady_state_batch(30, 5, 1.0) == 6  # = N/k
    assert metrics.steady_state_ideal_ms("continuous", _COMP, **kw) == pytest.approx(10 + 5 + 5 * 2.5)
    assert metrics.steady_state_ideal_ms("parallel", _COMP, **kw) == pytest.approx(max(15, 10 + 29))
    assert metrics.steady_state_ideal_ms("continuous", _COMP, arrivals_per_frame=0, **kw) == pytest.approx(15)
    with pytest.raises(ValueError, match="unknown setting"):
        metrics.steady_state_ideal_ms("baseline", _COMP, **kw)


def test_per_frame_ideal_uses_each_frames_own_work():
    kw = dict(num_steps=10, decode_steps=4, batch=2)
    assert metrics.ideal_frame_ms("isolated", _COMP, arrivals=1, **kw) == pytest.approx(15 + 10 + 4 * 1.5)
    assert metrics.ideal_frame_ms("isolated", _COMP, arrivals=0, num_steps=10, decode_steps=0, batch=0) == 15
    assert metrics.ideal_frame_ms("continuous", _COMP, arrivals=0, **kw) == pytest.approx(15 + 6)
    assert metrics.ideal_frame_ms("parallel", _COMP, arrivals=1, **kw) == pytest.approx(max(15, 10 + 6))
    frames = _frames([1, 1, 1], warmup=1)
    for f, (steps, b) in zip(frames, [(99, 9), (5, 1), (5, 4)]):
        f["decode_steps"], f["batch"] = steps, b
    mean = metrics.ideal_mean_frame_ms("continuous", _COMP, frames, num_steps=10)
    assert mean == pytest.approx(((15 + 5 * 1.0) + (15 + 5 * 2.0)) / 2)


def test_ideal_frames_with_several_heads_pay_one_prefix_pass_when_shared_and_one_per_head_when_isolated():
    """Three heads on one prefix: T_pre = 10, heads 2, 3, 4 ms; language as for one head."""
    comp = metrics.Components(prefill_ms=10.0, denoise_ms={}, decode_step_ms={1: 1.0, 2: 1.5},
                              heads_ms={"xr0": 2.0, "starvla": 3.0, "gr00t": 4.0})
    assert metrics.Components.from_json(comp.to_json()) == comp
    kw = dict(num_steps=0, decode_steps=4, batch=2)
    assert metrics.ideal_frame_ms("continuous", comp, arrivals=0, **kw) == pytest.approx(10 + 9 + 4 * 1.5)
    assert metrics.ideal_frame_ms("actions_only", comp, arrivals=1, **kw) == pytest.approx(19)
    assert metrics.ideal_frame_ms("isolated", comp, arrivals=1, **kw) == pytest.approx(3 * 10 + 9 + 10 + 6)
    assert metrics.ideal_frame_ms("isolated", comp, arrivals=0, num_steps=0, decode_steps=0, batch=0) == 39
    assert metrics.ideal_frame_ms("parallel", comp, arrivals=1, **kw) == pytest.approx(max(14, 10 + 6))
    steady = dict(num_steps=0, decode_len=30, tokens_per_frame=5)
    assert metrics.steady_state_ideal_ms("shared_kv", comp, **steady) == pytest.approx(19 + 29)
    assert metrics.steady_state_ideal_ms("isolated", comp, **steady) == pytest.approx(39 + 10 + 29)


def test_summarize_reports_every_metric_and_the_achieved_fraction():
    frames = _frames([10, 20, 20], tokens=[0, 10, 10], warmup=1)
    for f in frames:
        f["decode_steps"] = 0
    s = metrics.summarize(frames, [_request(0, 1, 2)], action_horizon=10, comp=_COMP, setting="shared_kv", num_steps=10)
    assert s["frames_measured"] == 2
    assert s["frame_ms_median"] == 20.0
    assert s["action_hz"] == pytest.approx(500.0)
    assert s["tokens_per_s"] == pytest.approx(500.0)
    assert s["request_latency_ms_mean"] == pytest.approx(40.0)
    assert s["ideal_frame_ms"] == pytest.approx(15.0)
    assert s["achieved_fraction"] == pytest.approx(0.75)


# --- arrival patterns ----------------------------------------------------------------------------


def test_arrival_module_examples_hold():
    result = doctest.testmod(arrivals)
    assert result.attempted >= 3 and result.failed == 0


def test_uniform_rate_is_an_interval_in_frames():
    assert arrivals.parse("uniform:1").schedule(3) == [[None], [None], [None]]
    assert [len(x) for x in arrivals.parse("uniform:2").schedule(5)] == [1, 0, 1, 0, 1]
    assert [len(x) for x in arrivals.parse("uniform:0.25").schedule(2)] == [4, 4]
    assert arrivals.parse("uniform:4").arrivals_per_frame == 0.25
    assert arrivals.parse("uniform:0.5:tmax=30").schedule(1) == [[30, 30]]
    assert arrivals.parse("uniform").schedule(1) == [[None]]
    assert arrivals.parse("none").schedule(2) == [[], []]


def test_burst_arrivals():
    sched = arrivals.parse("burst:3/4").schedule(9)
    assert [len(x) for x in sched] == [3, 0, 0, 0, 3, 0, 0, 0, 3]
    assert arrivals.parse("burst").arrivals_per_frame == 0.5  # default 4 every 8


def test_poisson_arrivals_are_seeded_and_have_the_requested_mean():
    p = arrivals.parse("poisson:1.5:tmax=30")
    a, b = p.schedule(400), p.schedule(400)
    assert a == b  # generator recreated per call
    counts = [len(x) for x in a]
    assert np.mean(counts) == pytest.approx(1.5, abs=0.2)
    assert all(t == 30 for x in a for t in x)
    assert arrivals.parse("poisson:1.5:seed=7").schedule(400) != a


def test_length_patterns():
    assert arrivals.parse("variable_length:5,20").schedule(3) == [[5], [20], [5]]
    p = arrivals.parse("random_length:5,20@0.3")
    assert p.weights == pytest.approx((0.7, 0.3))
    draws = [t for x in p.schedule(2000) for t in x]
    assert set(draws) == {5, 20}
    assert np.mean([t == 20 for t in draws]) == pytest.approx(0.3, abs=0.04)
    assert arrivals.parse("random_length:5,10,20@1,1,2").weights == pytest.approx((0.25, 0.25, 0.5))
    assert arrivals.parse("random_length:5,20:rate=2").arrivals_per_frame == 0.5


@pytest.mark.parametrize("spec", ["uniform:1", "uniform:0.5:tmax=30", "burst:4/8", "poisson:1.5:tmax=30:seed=3",
                                  "variable_length:5,20", "random_length:5,20@0.7,0.3", "none"])
def test_canonical_spec_round_trips(spec):
    p = arrivals.parse(spec)
    assert arrivals.parse(str(p)) == p


@pytest.mark.parametrize("spec, message", [
    ("poison:1", "unknown kind"), ("uniform:-1", "positive"), ("uniform:x", "number"), ("burst:4", "SIZE/EVERY"),
    ("poisson", "needs a mean"), ("random_length:5,20@1.5", r"P\(long\)"), ("random_length:5,20@1,2,3", "weights"),
    ("uniform:1:foo=2", "unknown option"), ("uniform:1:rate=2", "rate="), ("variable_length:5,20@0.5", "no weights"),
    ("random_length:5,20:tmax=3", "tmax="), ("", "non-empty"), ("uniform:1:2", "argument groups"),
])
def test_bad_arrival_specs_are_rejected_with_a_clear_message(spec, message):
    with pytest.raises(ValueError, match=message):
        arrivals.parse(spec)


def test_actions_only_reference_frame_is_prefill_plus_denoise_whatever_arrives():
    for n_arrivals, steps in ((0, 0), (3, 29)):
        got = metrics.ideal_frame_ms("actions_only", _COMP, num_steps=10, arrivals=n_arrivals, decode_steps=steps, batch=3)
        assert got == 15.0
