"""The embedded demo folder: it loads verified (every array against its SHA-256), fits in the repository, and
its answers are compared in one normal form."""

from __future__ import annotations

import numpy as np
import pytest

from oxygen_jax.demo import DEMO_DIR, load_demo, normalize_answer


def test_embedded_demo_loads_verified_and_fits_in_15_mb():
    if not (DEMO_DIR / "demo.json").is_file():
        pytest.skip(f"no embedded demo at {DEMO_DIR}")
    size = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert size <= 15e6, f"checkpoints/demo holds {size / 1e6:.1f} MB"
    demo = load_demo()  # restore_params verifies every array against its SHA-256, load_adapter every LoRA leaf
    assert demo.adapter_names == ("memory",) and demo.prompt == "Memory: "
    assert demo.tokenizer.vocab_size <= demo.config.vocab_size
    assert len(demo.frames) >= 8 and all(f["memory"].startswith("Done: ") for f in demo.frames)
    for f in demo.frames:  # LIBERO client images (make_observation resizes them to the model's side)
        assert f["image"].dtype == np.uint8 and f["image"].ndim == 3 and f["wrist_image"].shape == f["image"].shape


def test_answers_are_compared_after_normalisation():
    assert normalize_answer("  Done:  red block in basket. ") == "done: red block in basket"
    assert normalize_answer("done: red block in basket") == normalize_answer("Done: red block in basket.")
    assert normalize_answer("Done: nothing..") == "done: nothing."  # one trailing period only
    assert normalize_answer("Done: red") != normalize_answer("Done: blue")
