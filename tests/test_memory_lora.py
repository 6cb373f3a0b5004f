"""Suffix-only LoRA training: the teacher-forced forward is the slot pool's prompt pass bit for bit, only the
bank learns (base leaves bit-identical), base pre-training never touches the action expert, kill + resume
is bit-identical (CLI), 8 simulated devices match one, and saved adapters load or fail with named leaves."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import REPO, save_base
from oxygen_jax.ckpts.adapters import load_adapter, load_bank, save_adapter
from oxygen_jax.runtime import decode
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05 import model
from oxygen_jax.robots.config import robot_config
from oxygen_jax.models.pi05.params import for_backend
from oxygen_jax.robots.tokenizer import train_demo_tokenizer
from training.memory.__main__ import main
from training.memory.config import TrainConfig
from training.memory.data import TextTask, augment_frame
from training.memory.evaluate import greedy_exact_match
from training.memory.checkpoints import StateCheckpoints
from training.memory.loop import train
from training.memory.model import make_mesh, teacher_forced_logits, with_base_trainable
from training.data.frames import open_memory_dataset, write_memory_dataset
from training.data.synthetic_memory import SyntheticMemoryConfig, synthetic_splits
from training.flow.train_step import OptimizerConfig

PROMPT_LEN, SUFFIX_LEN, BATCH = 48, 40, 8
# One adapter config for the learning, resume and data-parallel tests (one compiled step); the CLI flags in
# the resume test spell out the same values.
ADAPTER = TrainConfig(steps=60, batch_size=BATCH, suffix_len=SUFFIX_LEN, rank=4, peak_lr=2e-2, final_lr=2e-3,
                      warmup_steps=2)
CLI_FLAGS = ["--steps", "60", "--batch-size", str(BATCH), "--suffix-len", str(SUFFIX_LEN), "--prompt-len",
             str(PROMPT_LEN), "--rank", "4", "--lr", "2e-2", "--final-lr", "2e-3", "--warmup", "2", "--devices", "1",
             "--eval-split", "", "--no-progress"]


def _tree_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def params(tiny_params):
    return for_backend(tiny_params)


@pytest.fixture(scope="module")
def task():
    return TextTask(robot=robot_config("libero", max_token_len=PROMPT_LEN), tokenizer=train_demo_tokenizer(),
                    prompt="Memory: ", label_key="memory", suffix_len=SUFFIX_LEN)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """The synthetic task at the tiny SigLIP's 56 px: 16 train frames (4 layouts x 4 labels), 4 held out."""
    frames = synthetic_splits(SyntheticMemoryConfig(image_size=56, num_inits=5, num_train_inits=4))
    return write_memory_dataset(tmp_path_factory.mktemp("syn"), frames, image_size=56, name="synthetic_memory")


@pytest.fixture(scope="module")
def train_frames(dataset):
    return open_memory_dataset(dataset, "train")


def _trained_looking_bank(params, seed=3):
    bank = pi05_lora.init_bank(params.config, 1, rank=4, seed=1)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)
        if getattr(path[-1], "name", None) == "b" else x, bank)


def test_teacher_forced_logits_equal_the_slot_pools_prompt_pass_bit_for_bit(params, task, train_frames):
    batch = task.batch([train_frames[i] for i in range(BATCH)], params.config)
    bank = _trained_looking_bank(params)
    prefix = model.prefill(params, batch.observation)
    tokens = batch.suffix_tokens
    ids = np.array([1, 0, 1, 1, 1, 1, 0, 1], np.int32)  # rows 1 and 6 on the base weights
    logits = np.asarray(teacher_forced_logits(params, batch, bank, ids))  # [B, T, V]

    @jax.jit
    def admission_logits(params, prefix, requests, bank):  # what decode._admit samples token 0 from
        lm = model.language_model(params)
        _, _, seed, _ = decode._extend_with_prompts(lm, lm.rows(prefix, requests.row), requests, SUFFIX_LEN, bank)
        return model.lm_logits_vocab_major(params, seed)

    n_ans = int(batch.suffix_mask.sum(1).max())
    for j in range(len(task.prompt_ids), n_ans):  # every position whose logits predict an answer token
        prompts = [list(tokens[b, : j + 1]) for b in range(BATCH)]
        req = decode.make_requests(BATCH, SUFFIX_LEN, list(range(BATCH)), rows=list(range(BATCH)), prompts=prompts,
                                   budgets=[1] * BATCH, adapters=ids.tolist())
        np.testing.assert_array_equal(logits[:, j], np.asarray(admission_logits(params, prefix, req, bank)).T, f"j={j}")


@pytest.fixture(scope="module")
def straight(params, task, train_frames):
    """ADAPTER trained without interruption on one device, evaluated on its own training frames."""
    before = jax.device_get(params)
    start_bank = pi05_lora.init_bank(params.config, 1, ADAPTER.rank, seed=ADAPTER.seed)  # B = 0: the base model
    em_before = greedy_exact_match(params, task, train_frames, bank=start_bank, batch_size=BATCH)
    result = train(ADAPTER, params, task, train_frames, eval_source=train_frames, mesh=make_mesh(1), log_every=5)
    return dict(result=result, before=before, start_bank=start_bank, em_before=em_before)


def test_adapter_training_updates_only_the_bank_and_learns_the_training_frames(params, straight):
    assert _tree_equal(params, straight["before"])  # every base leaf, bit for bit
    bank, start = jax.device_get(straight["result"].state.trainable), straight["start_bank"]
    for target, pair in bank.adapters.pairs().items():
        assert np.abs(pair.b).max() > 0, target  # B left zero: the adapter learned something
        assert not np.array_equal(pair.a, getattr(start.adapters, target).a), target
    history = straight["result"].history
    losses = [h["loss"] for h in history if h["event"] == "train"]
    assert losses[-1] < 0.5 * losses[0]
    em_after = [h for h in history if h["event"] == "eval"][-1]["exact_match"]
    assert straight["em_before"] == 0.0 and em_after >= 0.375, (straight["em_before"], em_after)  # 0.5625 measured


def test_base_pretraining_updates_vlm_siglip_and_embedding_never_the_action_expert(params, task, train_frames):
    scene = dataclasses.replace(task, prompt="Scene: ", label_key="scene", suffix_len=48)
    cfg = TrainConfig(mode="base", prompt="Scene: ", label_key="scene", steps=3, batch_size=BATCH, suffix_len=48,
                      peak_lr=1e-3, warmup_steps=1)
    result = train(cfg, params, scene, train_frames, log_every=1)
    new = with_base_trainable(params, jax.device_get(result.state.trainable))
    for field in ("action_expert", "action_in", "time_mlp_in", "time_mlp_out", "action_out"):
        assert _tree_equal(getattr(new, field), getattr(params, field)), field
    for field in ("embedding", "vlm", "siglip"):
        old, upd = jax.tree.leaves(getattr(params, field)), jax.tree.leaves(getattr(new, field))
        assert all(not np.array_equal(a, b) for a, b in zip(old, upd)), field  # every leaf moved
    losses = [h["loss"] for h in result.history if h["event"] == "train"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_cli_kill_and_resume_is_bit_identical_to_a_straight_run(params, dataset, straight, tmp_path, capsys):
    final = jax.device_get(straight["result"].state)
    base = save_base(tmp_path / "base", params)
    out = tmp_path / "run"
    flags = ["--data", str(dataset), "--out", str(out), "--base", str(base), "--checkpoint-every", "30", *CLI_FLAGS]
    assert main(flags + ["--stop-at", "30"]) == 0  # "killed" after step 30, just after its checkpoint
    assert "stopped at step 30" in capsys.readouterr().out
    assert main(flags) == 0  # the same command resumes from step 30
    assert '"resumed"' in (out / "metrics.jsonl").read_text()

    ckpt = StateCheckpoints(out / "checkpoints")
    resumed = ckpt.restore(final, {})
    assert int(resumed.step) == 60
    assert _tree_equal(resumed.trainable, final.trainable)  # the bank, bit for bit
    assert _tree_equal(resumed.opt_state, final.opt_state)  # Adam moments and counts too
    with pytest.raises(ValueError, match="another train config"):  # another run cannot resume this one
        ckpt.restore(final, {"train": dataclasses.replace(ADAPTER, rank=8).to_json()})
    ckpt.close()
    adapter, meta = load_adapter(out / "adapter", params.config, base=base)
    assert _tree_equal(adapter, final.trainable.adapter(1))
    assert meta["name"] == "memory" and meta["rank"] == 4 and meta["prompt"] == "Memory: "


def test_saved_adapters_that_do_not_fit_fail_naming_every_leaf(params, tmp_path):
    bank = _trained_looking_bank(params)
    base = save_base(tmp_path / "base", params)
    path = save_adapter(tmp_path / "a", bank.adapter(1), name="memory", prompt="Memory: ", base=base)
    loaded, names = load_bank([path], params.config, base=base)
    assert names == ("memory",) and _tree_equal(loaded, bank)

    wide = params.config.replace(vlm=dataclasses.replace(params.config.vlm, width=96))
    with pytest.raises(ValueError, match=r"(?s)q_einsum/lora_a.*expected.*96") as err:
        load_adapter(path, wide, base=base)
    assert "kv_einsum/lora_a" in str(err.value) and "gating_einsum_lora_a" in str(err.value)

    other = save_adapter(tmp_path / "b", pi05_lora.init_bank(params.config, 1, rank=8).adapter(1), name="narrate",
                         prompt="Narrate: ", base=base)
    with pytest.raises(ValueError, match=r"(?s)adapter 1 \(id 2\) does not match.*q\.a: expected"):
        load_bank([path, other], params.config, base=base)

    meta = json.loads((path / "adapter.json").read_text())
    meta["leaves"]["PaliGemma/llm/layers/mlp/linear_lora_b"]["sha256"] = "0" * 64
    (path / "adapter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="linear_lora_b.*does not match its SHA-256"):
        load_adapter(path, params.config, base=base)


def test_base_fingerprint_mismatch_is_an_error(params, tmp_path):
    base_a = save_base(tmp_path / "base_a", params)
    shifted = params.replace(embedding=params.embedding + 1.0)
    base_b = save_base(tmp_path / "base_b", shifted)
    path = save_adapter(tmp_path / "a", _trained_looking_bank(params).adapter(1), prompt="Memory: ", base=base_a)
    load_adapter(path, params.config, base=base_a)
    with pytest.raises(ValueError, match="was trained on base .*base_a.*other weights"):
        load_adapter(path, params.config, base=base_b)


def test_augmentation_is_a_pure_function_of_the_draw_and_only_shifts_and_scales():
    frame = {"image": np.tile(np.arange(56, dtype=np.uint8)[None, :, None] * 4, (56, 1, 3)),
             "wrist_image": np.full((56, 56, 3), 100, np.uint8), "memory": "Done: nothing."}
    a = augment_frame(frame, 0.1, np.random.default_rng([0, 7, 1]))
    b = augment_frame(frame, 0.1, np.random.default_rng([0, 7, 1]))
    assert all(np.array_equal(a[k], b[k]) for k in ("image", "wrist_image")) and a["memory"] == frame["memory"]
    assert a["image"].shape == frame["image"].shape and a["image"].dtype == np.uint8
    assert 90 <= int(a["wrist_image"][0, 0, 0]) <= 110  # brightness within 1 +- 0.1
    cols = a["image"][28, :, 0].astype(int)
    assert np.all(np.diff(cols) >= 0)  # a shifted (edge-padded) copy of the ramp, not a scramble
    with pytest.raises(ValueError, match="augment must be in"):
        TrainConfig(augment=0.6)


def test_cli_rejects_an_adapter_run_without_a_base_in_one_line(tmp_path, capsys):
    assert main(["--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "adapter mode needs --base" in err


@pytest.mark.parametrize("flag, value, expected", [
    ("--train-tokenizer", "256", "--train-tokenizer: expected 0 or a vocabulary of at least 300"),
    ("--steps", "0", "--steps: expected an integer >= 1, got 0"),
    ("--rank", "x", "--rank: expected an integer >= 1, got 'x'"),
])
def test_cli_rejects_a_bad_flag_by_name_in_one_line_before_loading_anything(tmp_path, capsys, flag, value, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and expected in err
    assert not (tmp_path / "o").exists()  # nothing created


_DATA_PARALLEL = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from oxygen_jax.models.pi05.config import model_config
    from oxygen_jax.robots.config import robot_config
    from oxygen_jax.models.pi05.params import for_backend, init_params
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer
    from training.data.frames import open_memory_dataset
    from training.memory.config import TrainConfig
    from training.memory.data import TextTask
    from training.memory.loop import train
    from training.memory.model import make_mesh

    assert jax.device_count() == 8, jax.devices()
    dataset, prompt_len, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    cfg = TrainConfig.from_json(json.loads(sys.argv[4]))
    task = TextTask(robot=robot_config("libero", max_token_len=prompt_len), tokenizer=train_demo_tokenizer(),
                    prompt="Memory: ", label_key="memory", suffix_len=cfg.suffix_len)
    params = for_backend(init_params(model_config("tiny"), 0))
    frames = open_memory_dataset(dataset, "train")
    arrays = {}
    for steps in (1, 2):  # one compiled step; each run starts from the initial state
        r = train(cfg, params, task, frames, mesh=make_mesh(8), stop_at=steps, log_every=1)
        arrays |= {f"{steps}:{jax.tree_util.keystr(k)}": np.asarray(x) for k, x in
                   jax.tree_util.tree_flatten_with_path(jax.device_get(r.state))[0]}
    rows = r.state.trainable.adapters.q.a.sharding.device_set
    names = sorted(arrays)
    np.savez(out, losses=[h["loss"] for h in r.history], n_devices=len(rows), names=np.array(names),
             *[arrays[n] for n in names])
""")

# Gradient agreement between the two programs: the 8-device step sums each device's rows, then all-reduces;
# the one-device step sums all rows in one reduction. Both are the same mean in exact arithmetic, so they
# may differ only by float32 rounding of sums taken in another order: per element at most a few hundred
# ulps of the leaf's largest gradient (entries that are small differences of large terms have no relative
# bound), plus a relative 1e-5 for the global-norm clip factor computed from those sums.
_GRAD_RTOL, _GRAD_ATOL = 1e-5, 3e-5  # atol relative to the leaf's largest |gradient| (~250 float32 ulps)


def _state_names(state, steps: int) -> dict[str, np.ndarray]:
    return {f"{steps}:{jax.tree_util.keystr(k)}": np.asarray(x)
            for k, x in jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]}


def _adam_bounds(one: dict, cfg: TrainConfig, steps: int):
    """Yields (name, one-device value, allowed |difference|) for every float leaf after `steps` AdamW steps.

    From the one-device state, the clipped gradients g_t are recovered exactly from the first moments
    (mu_1 = (1-b1) g_1, mu_2 = b1 mu_1 + (1-b1) g_2); each may be off by dg_t = rtol |g_t| + atol max|g_t|.
    Propagated through the maths of AdamW:
      mu_t is linear in the g's:           |dmu_t| <= (1-b1) sum_k b1^(t-k) dg_k;
      sqrt(nu_t) = sqrt(1-b2) ||(b2^((t-k)/2) g_k)_k||, 1-Lipschitz in that vector:
                                           |dsqrt(nu_t)| <= sqrt(1-b2) ||(b2^((t-k)/2) dg_k)_k||;
      u_t = mu_hat / (sqrt(nu_hat) + eps) is monotone in mu and in sqrt(nu), so its largest change over those
      intervals is at a corner; p_t = p_(t-1) - lr_(t-1) (u_t + wd p_(t-1)) adds lr_(t-1) |du_t| per step.
    Near-zero gradients make u (and the parameters) sensitive, up to a sign flip of u (2 lr): that is Adam,
    not an error, and the bound says exactly how much each element may move.
    """
    adam = OptimizerConfig()  # TrainConfig.optimizer() keeps its b1, b2 and eps
    b1, b2, eps, wd = adam.b1, adam.b2, adam.eps, cfg.weight_decay
    lr = [_schedule_lr(cfg, k) for k in range(steps)]
    names = [n for n in one if n.startswith(f"{steps}:") and ".mu" in n]
    for mu_name in names:
        leaf = mu_name[mu_name.index(".mu") + 3:]  # the trainable leaf's path inside mu
        mu = {t: one[mu_name.replace(f"{steps}:", f"{t}:", 1)].astype(np.float64) for t in range(1, steps + 1)}
        g = {1: mu[1] / (1 - b1)}
        if steps == 2:
            g[2] = (mu[2] - b1 * mu[1]) / (1 - b1)
        dg = {t: _GRAD_RTOL * np.abs(x) + _GRAD_ATOL * np.abs(x).max() for t, x in g.items()}
        dmu = (1 - b1) * sum(b1 ** (steps - k) * dg[k] for k in g)
        dsq = np.sqrt((1 - b2) * sum(b2 ** (steps - k) * dg[k] ** 2 for k in g))
        nu = one[mu_name.replace(".mu", ".nu")].astype(np.float64)
        yield mu_name, mu[steps], dmu
        yield mu_name.replace(".mu", ".nu") + " (sqrt)", np.sqrt(nu), dsq
        p_name = next(n for n in one if n.startswith(f"{steps}:") and n.endswith(leaf) and ".trainable" in n)
        dp = np.zeros_like(dmu)
        for t in range(1, steps + 1):
            m_t = one[mu_name.replace(f"{steps}:", f"{t}:", 1)].astype(np.float64)
            s_t = np.sqrt(one[mu_name.replace(f"{steps}:", f"{t}:", 1).replace(".mu", ".nu")].astype(np.float64))
            dm_t = (1 - b1) * sum(b1 ** (t - k) * dg[k] for k in range(1, t + 1))
            ds_t = np.sqrt((1 - b2) * sum(b2 ** (t - k) * dg[k] ** 2 for k in range(1, t + 1)))

            def u(m, sq, t=t):
                return (m / (1 - b1 ** t)) / (sq / np.sqrt(1 - b2 ** t) + eps)

            du = np.maximum.reduce([np.abs(u(m_t + a * dm_t, np.maximum(s_t + c * ds_t, 0)) - u(m_t, s_t))
                                    for a in (-1, 1) for c in (-1, 1)])
            dp = dp * (1 - lr[t - 1] * wd) + lr[t - 1] * du
        yield p_name, one[p_name].astype(np.float64), dp


def _schedule_lr(cfg: TrainConfig, count: int) -> float:
    """The AdamW learning rate of step `count` (0-based): `TrainConfig.optimizer`'s schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=cfg.peak_lr / (cfg.warmup_steps + 1), peak_value=cfg.peak_lr, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.final_lr)
    return float(schedule(count))


def test_data_parallel_over_8_simulated_devices_matches_one_device(params, task, train_frames, dataset, tmp_path):
    """8 devices agree with one to float32 summation order: gradients (first moments), and the Adam state and
    parameters within what AdamW's maths lets those rounding differences become (`_adam_bounds`).

    An elementwise rtol on the Adam state is not portable: sqrt(nu) divides near-zero gradients, so a rounding
    difference of a few ulps of the leaf's scale moves such an element by up to 2 lr (seen on another machine of
    this kind: one element of 1,024 off by 2.3e-4 relative)."""
    one = {**_state_names(train(ADAPTER, params, task, train_frames, mesh=make_mesh(1), stop_at=1).state, 1)}
    run2 = train(ADAPTER, params, task, train_frames, mesh=make_mesh(1), stop_at=2, log_every=1)  # the cached step
    one |= _state_names(run2.state, 2)
    # The suite's XLA flags (tests/conftest.py: fast-compile codegen, or XLA's defaults) plus 8 host devices: the
    # 8-device program is compiled as the one-device step above was (replacing the flags made it compile at -O2).
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    out = tmp_path / "eight.npz"
    proc = subprocess.run([sys.executable, "-c", _DATA_PARALLEL, str(dataset), str(PROMPT_LEN), str(out), json.dumps(ADAPTER.to_json())],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    eight_npz = np.load(out)
    assert int(eight_npz["n_devices"]) == 8  # the state lives on all 8 devices, the batch was split over them
    eight = {str(n): eight_npz[f"arr_{i}"] for i, n in enumerate(eight_npz["names"])}
    assert sorted(eight) == sorted(one)
    np.testing.assert_allclose(eight_npz["losses"], [h["loss"] for h in run2.history], rtol=1e-5)
    for name, x in one.items():
        if not np.issubdtype(x.dtype, np.floating):  # step counters
            np.testing.assert_array_equal(eight[name], x, err_msg=name)
    checked = 0
    for steps in (1, 2):
        for name, want, bound in _adam_bounds(one, ADAPTER, steps):
            got = eight[name.removesuffix(" (sqrt)")].astype(np.float64)
            got = np.sqrt(got) if name.endswith("(sqrt)") else got
            slack = 1e-6 * np.abs(want) + 1e-9  # the optimizer's own float32 arithmetic
            excess = np.abs(got - want) - (bound + slack)
            assert (excess <= 0).all(), (f"{name}: {int((excess > 0).sum())} of {want.size} elements beyond the bound, "
                                         f"worst by {excess.max():.3g}")
            checked += 1
            if steps == 2 and ".trainable" in name:  # not vacuous: most entries may move far less than a step moves them
                step_move = np.abs(want - one[name.replace("2:", "1:", 1)])
                assert np.median(bound) < 0.01 * np.median(step_move), name
    assert checked == 2 * 3 * len([n for n in one if n.startswith("2:") and ".mu" in n])
