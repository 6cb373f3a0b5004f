"""Qwen3.5 against transformers at dims other than the public fixture's, without torch: the reference
outputs in tests/data/qwen35_refs (made by `eval/refs/qwen35_refs.py`, its COMPACT shapes: an untied head with
2 groups of (linear, linear, full) and conv kernel 3; a tied head with 3 groups of (linear, full), full
rotary and kernel 5; both Dk != Dv) compared by `eval.parity.qwen35` at its stated tolerances: logits,
every hidden state, full-layer K/V, delta-rule outputs, conv windows and recurrent states after prefill,
greedy tokens, step logits and states of a cached decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.parity import qwen35 as parity

_REFS = Path(__file__).parent / "data" / "qwen35_refs"
_DIRS = sorted(p for p in _REFS.iterdir() if (p / "reference.npz").is_file())


def test_the_reference_shapes_cover_untied_heads_and_odd_group_counts():
    configs = [json.loads((d / "config.json").read_text()) for d in _DIRS]
    assert len(configs) >= 2
    assert {c["tie_word_embeddings"] for c in configs} == {True, False}
    groups = [len(c["layer_types"]) // (c["layer_types"].index("full_attention") + 1) for c in configs]
    assert any(g % 2 for g in groups)
    assert any(c["linear_key_head_dim"] != c["linear_value_head_dim"] for c in configs)


@pytest.mark.parametrize("ref_dir", _DIRS, ids=[d.name for d in _DIRS])
def test_every_quantity_is_within_the_stated_tolerance(ref_dir):
    spec, rows = parity.run_fixture(ref_dir, pool=False)
    failed = [f"{r.quantity}: {r.max_abs:.3g} ({r.tol})" for r in rows if not r.ok]
    assert not failed, failed
    names = {r.quantity for r in rows}
    for q in ("text logits (valid tokens)", "text hidden_states[1] (valid tokens)", "text k_cache, full layers (valid tokens)",
              "text linear layers' gdn_core (valid tokens)", "text recurrent_states, rows without right padding, vs HF batch",
              "text conv_states after decoding", "text greedy tokens, cached decode (6 steps)", "text decode step logits"):
        assert q in names, f"{q} not compared"
    assert spec.backbone.tie_embeddings == json.loads((ref_dir / "config.json").read_text())["tie_word_embeddings"]
