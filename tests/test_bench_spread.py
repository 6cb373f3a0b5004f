"""eval.bench.spread: every bench figure carries its spread over the measured frames, and is rounded to it."""

from __future__ import annotations

import pytest

from eval.bench import spread


@pytest.mark.parametrize("width, digits", [(0.313, 1), (0.034, 2), (1.9, 0), (190.0, -2), (0.0, None), (None, None),
                                           (float("nan"), None)])
def test_decimals_keep_the_leading_digit_of_the_spread_and_no_more(width, digits):
    assert spread.decimals(width) == digits


def test_figures_are_rounded_to_their_spread():
    assert spread.with_spread(2.347, 2.118, 2.431) == "2.3 (2.1–2.4)"
    assert spread.with_spread(2334.0, 2210.0, 2400.0) == "2,300 (2,200–2,400)"
    assert spread.with_spread(1.2139, 1.187, 1.262) == "1.21 (1.19–1.26)"
    assert spread.with_spread(1.0, 1.0, 1.0) == "1.00"  # no spread (isolated against itself): default decimals
    assert spread.with_spread(None, 1.0, 2.0) == "–"
    # a rate that scales with 1 / frame time: 10 % relative spread on 31.2 tokens/s leaves the units digit
    assert spread.rounded(31.24, 0.1) == "31" and spread.rounded(31.24, 0.01) == "31.2"
    assert spread.rounded(31.24, None) == "31.24"


def _frame(f, setting, ms, k=None, label=None, warmup=False, drain=False):
    return {"frame": f, "setting": setting, "k": k, "label": label or setting, "frame_ms": ms, "warmup": warmup,
            "drain": drain}


def test_annotate_adds_frame_quartiles_and_per_frame_speedup_quartiles_from_the_run_file():
    frames = [_frame(0, "isolated", 99.0, warmup=True), _frame(0, "shared_kv", 1.0, warmup=True)]
    frames += [_frame(f, "isolated", ms) for f, ms in zip(range(1, 5), (10.0, 12.0, 14.0, 16.0))]
    frames += [_frame(f, "shared_kv", ms) for f, ms in zip(range(1, 5), (5.0, 6.0, 7.0, 8.0))]
    # a continuous runner with an adapter shares setting and k with the plain one: its frames stay apart
    frames += [_frame(f, "continuous", 4.0, k=2, label="continuous[k=2]") for f in range(1, 5)]
    frames += [_frame(f, "continuous", 400.0, k=2, label="continuous[k=2,adapter=0.5]") for f in range(1, 5)]
    frames += [_frame(5, "continuous", 1000.0, k=2, label="continuous[k=2]", drain=True)]
    summary = [{"setting": s, "k": k, "frame_ms_median": med, "adapter_share": 0, "run_file": "runs/g.json"}
               for s, k, med in (("isolated", None, 13.0), ("shared_kv", None, 6.5), ("continuous", 2, 4.0))]
    iso, kv, cb = spread.annotate(summary, {"runs/g.json": {"frames": frames}})
    assert (kv["frame_ms_lo"], kv["frame_ms_hi"], kv["spread"]) == (5.75, 7.25, "IQR")  # warm-up frame excluded
    assert kv["frame_rel_width"] == pytest.approx(1.5 / 6.5)
    assert (kv["speedup_lo"], kv["speedup_hi"]) == (2.0, 2.0)  # every frame exactly twice as fast
    assert (iso["speedup_lo"], iso["speedup_hi"]) == (1.0, 1.0)
    assert (cb["frame_ms_lo"], cb["frame_ms_hi"]) == (4.0, 4.0)  # no adapter frames, no drain frame
    assert "frame_ms_lo" not in summary[0]  # copies: summary.json's records are left as they were


def test_without_a_run_file_the_spread_is_the_min_max_that_summary_json_keeps():
    rec = {"setting": "shared_kv", "k": None, "frame_ms_median": 6.0, "frame_ms_min": 5.0, "frame_ms_max": 9.0,
           "run_file": "runs/missing.json"}
    (out,) = spread.annotate([rec], {})
    assert (out["frame_ms_lo"], out["frame_ms_hi"], out["spread"]) == (5.0, 9.0, "min–max")
    assert "speedup_lo" not in out
