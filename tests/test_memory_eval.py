"""Memory-adapter evaluation: normalised exact match, per-label accuracy and confusion, majority baselines,
and actions that never see the bank (on / off / zeroed differ by exactly 0), end to end through the CLI."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import save_base

from eval.memory_eval import OTHER, label_metrics, main, majority, to_markdown, zeroed_bank
from oxygen_jax.ckpts.adapters import save_adapter
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.params import for_backend
from training.data.frames import write_memory_dataset
from training.memory.data import MEMORY_PROMPT
from training.data.synthetic_memory import SyntheticMemoryConfig, all_labels, synthetic_splits

REFS = ["Done: nothing.", "Done: red block in basket.", "Done: red block in basket.", "Done: blue block on plate."]


def test_label_metrics_normalise_before_comparing_and_count_other_answers():
    preds = ["done:  nothing", "Done: red block in basket.", "Done: blue block on plate.", "the plate"]
    m = label_metrics(preds, REFS)
    assert m["n"] == 4 and m["exact_match"] == 0.5  # case, spacing and the final period do not matter
    red = "done: red block in basket"
    assert m["per_label"][red] == {"n": 2, "correct": 1, "accuracy": 0.5}
    assert m["confusion"][red] == {red: 1, "done: blue block on plate": 1}
    assert m["confusion"]["done: blue block on plate"] == {OTHER: 1}  # not a label at all
    with pytest.raises(ValueError, match="as many predictions as references"):
        label_metrics(preds[:3], REFS)


def test_majority_counts_normalised_labels_and_breaks_ties_by_first_seen():
    assert majority(REFS) == ("done: red block in basket", 2)
    assert majority(["Done: b.", "done: a", "Done: a.", "done: b"]) == ("done: b", 2)


def test_zeroed_bank_keeps_a_and_zeroes_every_b(tiny_params):
    bank = pi05_lora.init_bank(tiny_params.config, 1, rank=2)
    bank = jax.tree.map(lambda x: np.asarray(x) + 1.0, bank)
    zero = zeroed_bank(bank)
    for target, pair in zero.adapters.pairs().items():
        assert not np.any(np.asarray(pair.b)), target
        np.testing.assert_array_equal(pair.a, getattr(bank.adapters, target).a)


@pytest.fixture(scope="module")
def run_cli(tiny_params, tmp_path_factory):
    """The CLI on a random-B adapter over the tiny base: 4 held-out synthetic frames (one per label)."""
    root = tmp_path_factory.mktemp("memeval")
    frames = synthetic_splits(SyntheticMemoryConfig(image_size=56, num_inits=5, num_train_inits=4))
    data = write_memory_dataset(root / "data", frames, image_size=56, name="synthetic_memory")
    params = for_backend(tiny_params)
    base = save_base(root / "base", params)
    bank = pi05_lora.init_bank(params.config, 1, rank=4, seed=1)
    rng = np.random.default_rng(0)
    bank = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)
        if getattr(path[-1], "name", None) == "b" else x, bank)
    adapter = save_adapter(root / "adapter", bank.adapter(1), prompt=MEMORY_PROMPT, base=base,
                           extra={"label_key": "memory", "suffix_len": 40, "prompt_len": 48})
    out = root / "report"
    rc = main(["--base", str(base), "--adapter", str(adapter), "--data", str(data), "--out", str(out),
               "--batch-size", "8", "--num-steps", "1"])
    return rc, out, SyntheticMemoryConfig(image_size=56)


def test_cli_report_actions_never_see_the_adapter(run_cli):
    rc, out, _ = run_cli
    assert rc == 0
    report = json.loads((out / "memory_eval.json").read_text())
    assert report["n"] == 4
    assert report["action_max_abs_diff"] == {"on_vs_off": 0.0, "on_vs_zeroed": 0.0, "off_vs_zeroed": 0.0}
    assert report["zeroed_exact_match_vs_base"] == 1.0  # a zeroed adapter answers exactly like the base model


def test_cli_report_has_metrics_baselines_and_tables(run_cli):
    rc, out, syn = run_cli
    report = json.loads((out / "memory_eval.json").read_text())
    for key in ("exact_match", "token_accuracy", "base_exact_match"):
        assert 0.0 <= report[key] <= 1.0, key
    assert np.isfinite(report["answer_loss"])
    # 16 training frames, 4 per label: a tie, won by the first label seen ("Done: nothing.", mask 0).
    assert report["majority_label"] == "done: nothing"
    assert report["majority_baseline"] == 0.25 and report["per_task_majority_baseline"] == 0.25
    labels = {lab.casefold().rstrip(".") for lab in all_labels(syn)}
    assert set(report["per_label"]) == labels and all(r["n"] == 1 for r in report["per_label"].values())
    assert all(sum(row.values()) == 1 for row in report["confusion"].values())
    (instruction, row), = report["per_instruction"].items()  # the synthetic task has one instruction
    assert instruction.startswith("put the red block") and row["n"] == 4
    assert row["accuracy"] == report["exact_match"] and row["majority_baseline"] == 0.25
    assert report["train_frames"] == 16 and report["train_layouts"] == 4  # one instruction, 4 init indices
    assert report["per_task_oracle_constant"] == 0.25  # 4 held-out frames, 4 different labels
    md = (out / "memory_eval.md").read_text()
    assert md == to_markdown(report)
    assert "| exact match (adapter) |" in md and "## Confusion" in md and "majority-label baseline" in md
