"""`eval.bench.families` tabulates each family's own run: per N the isolated frame of that run, each setting's
speedup over it as the run recorded it, and the published RTX 4090 number of the same family and N."""

from __future__ import annotations

import json

from eval.bench import families


def _record(setting, n, ms, speedup, s=0):
    return {"setting": setting, "workload": "libero", "N": n, "S": s, "frame_ms_median": ms, "speedup_vs_isolated": speedup}


def test_rows_pair_each_n_with_its_own_isolated_frame_and_the_published_speedup(tmp_path):
    summaries = {"xr0": [_record("isolated", n, 100.0 * n, 1.0) for n in families.N_VALUES]
                 + [_record("continuous", n, 50.0 * n, 2.0 + n / 100) for n in families.N_VALUES]
                 + [_record("shared_kv", 30, 2000.0, 1.5)]}
    rows = families.rows(summaries)
    assert [r["N"] for r in rows] == list(families.N_VALUES)
    for r, published in zip(rows, families.PUBLISHED_4090["xr0"]):
        assert r["isolated_ms"] == 100.0 * r["N"] and r["continuous_speedup"] == 2.0 + r["N"] / 100
        assert r["published_4090_continuous"] == published and r["S"] == 5  # S 0 = "each head its own": XR0's 5
    assert rows[0]["shared_kv_speedup"] is None and rows[-1]["shared_kv_speedup"] == 1.5
    md = families.table(rows)
    assert "| xr0 | 5 | 5 | 500 | – | 250 | –× | 2.05× | 1.03× |" in md
    (tmp_path / "xr0").mkdir()
    (tmp_path / "xr0" / "summary.json").write_text(json.dumps(summaries["xr0"]))
    (tmp_path / "xr0" / "environment.json").write_text(json.dumps({"backend": "cpu", "cpu_count": 2}))
    assert md in families.write(tmp_path) and (tmp_path / "families.json").is_file()


def test_slot_memory_is_the_continuous_runs_slot_at_the_largest_n():
    kv = lambda n: {"kv": 100 * n, "window": 7, "state": 9, "total": 100 * n + 20}  # noqa: E731
    records = [dict(_record("continuous", n, 1.0, 1.0), slot_bytes=kv(n)) for n in (5, 30, 10)]
    records += [dict(_record("isolated", 40, 1.0, 1.0), slot_bytes=None)]
    assert families.slot_memory({"qwen35_starvla_gr00t": records, "pi05": [_record("continuous", 5, 1.0, 1.0)]}) == {
        "qwen35_starvla_gr00t": kv(30)}
