"""Per-slot language adapters: served on the suffix path only, batched across adapters, never touching actions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import diverse_text_params, make_obs
from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.runtime import decode
from oxygen_jax.models import lora
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05 import model
from oxygen_jax.runtime import frame as schedule
from oxygen_jax.runtime.engine import Engine, EngineConfig, RequestError

HA, N, PROMPT = 4, 5, [7, 8, 9]


def _random_b(bank: lora.LoraBank, seed: int, scale: float = 0.3) -> lora.LoraBank:
    """The bank with every B factor drawn at random (a trained-looking adapter; init_bank has B = 0)."""
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if getattr(path[-1], "name", None) == "b":
            return jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(fill, bank)


@pytest.fixture(scope="module")
def params(tiny_params):
    return diverse_text_params(tiny_params)


@pytest.fixture(scope="module")
def banks(params):
    zero = pi05_lora.init_bank(params.config, 2, rank=4, alpha=8.0, seed=1)  # alpha != rank
    return {"none": None, "zero": zero, "random": _random_b(zero, 2)}


@pytest.fixture(scope="module")
def obs(params):
    return make_obs(params.config, batch=2, cameras=2, lengths=[6, 9], image_masks=[[True, False], [True, True]])


def _pool_decode(params, cache, rows, adapters, bank, steps=N - 1):
    """Admits one request per slot (the same prompt), then `steps` decode steps; (tokens, logits [steps, Ns, V])."""
    n = len(rows)
    pool = decode.init_pool(model.language_model(params), n, cache.length, N, len(PROMPT))
    req = decode.make_requests(n, len(PROMPT), list(range(n)), rows=rows, prompts=[PROMPT] * n, budgets=[N] * n,
                               stop_ids=[-1] * n, adapters=adapters)
    pool, _, _ = decode.admit(model.language_model(params), pool, cache, req, bank)
    logits = []
    for _ in range(steps):
        pool, _, lg = decode.decode_step(model.language_model(params), pool, bank)
        logits.append(np.asarray(lg))
    return np.asarray(pool.tokens), np.stack(logits)


def test_a_zero_initialised_adapter_is_bit_identical_to_the_base_weights(params, banks, obs):
    cache = model.prefill(params, obs)  # (3 slots, as in the next test: the compiled programs are shared)
    base_tokens, base_logits = _pool_decode(params, cache, [0, 1, 0], [0, 0, 0], None)
    tokens, logits = _pool_decode(params, cache, [0, 1, 0], [1, 2, 0], banks["zero"])
    np.testing.assert_array_equal(tokens, base_tokens)
    np.testing.assert_array_equal(logits, base_logits)


def test_mixed_pool_slots_each_match_their_adapter_merged_into_the_weights(params, banks, obs):
    bank, cache = banks["random"], model.prefill(params, obs)
    rows, ids = [0, 1, 0], [0, 1, 2]
    tokens, logits = _pool_decode(params, cache, rows, ids, bank)
    base_tokens, base_logits = _pool_decode(params, cache, rows, [0, 0, 0], None)
    np.testing.assert_array_equal(tokens[0], base_tokens[0])  # slots on adapter 0: today's decode, bit for bit
    np.testing.assert_array_equal(logits[:, 0], base_logits[:, 0])
    for slot, (row, aid) in enumerate(zip(rows, ids)):
        if aid == 0:
            continue
        # Reference: base prefix cache, suffix (prompt + decode) through weights with the adapter merged in.
        layers = lora.merge_layers(params.vlm.layers, bank.adapter(aid))
        merged = params.replace(vlm=dataclasses.replace(params.vlm, layers=layers))
        ref_tokens, ref_logits = _pool_decode(merged, cache, [row], [0], None)
        np.testing.assert_array_equal(tokens[slot], ref_tokens[0])
        np.testing.assert_allclose(logits[:, slot], ref_logits[:, 0], atol=2e-4, rtol=1e-5)
        assert not np.array_equal(tokens[slot], base_tokens[slot]) or not np.allclose(logits[:, slot], base_logits[:, slot])


def test_actions_and_prefix_never_depend_on_the_bank_in_any_setting(params, banks, obs):
    noise = jax.random.normal(jax.random.key(3), (2, HA, 32))
    vla, noises = model.as_vla(params, 2), {"actions": noise}
    q = len(PROMPT)
    results = {}
    for name, bank in banks.items():
        r = decode.make_requests(2, q, [0, 1], rows=[0, 1], prompts=[PROMPT] * 2, budgets=[N, N], stop_ids=[-1, -1],
                                 adapters=[0, 0] if bank is None else [1, 2])
        pool = decode.init_pool(model.language_model(params), 2, model.prefix_length(params, obs), N, q)
        _, out = schedule.frame_step(vla, pool, obs, noises, r, np.zeros(2, bool), bank, tokens_per_frame=2)
        sh_actions, sh_tokens, _ = schedule.shared_kv_program(vla, obs, noises, r, bank, max_new_tokens=N)
        par_actions, par_tokens, _ = schedule.run_parallel(vla, obs, noises, r, bank, max_new_tokens=N)
        iso_tokens, _ = schedule.text_program(vla, obs, r, bank, max_new_tokens=N)
        results[name] = dict(continuous=np.asarray(out.actions["actions"]), shared_kv=np.asarray(sh_actions["actions"]),
                             parallel=np.asarray(par_actions["actions"]), tokens=np.asarray(sh_tokens),
                             iso_tokens=np.asarray(iso_tokens), par_tokens=np.asarray(par_tokens))
    iso_actions = np.asarray(schedule.head_program(vla, "actions", obs, noises))  # takes no bank at all
    for name in banks:
        for setting in ("continuous", "shared_kv", "parallel"):
            np.testing.assert_array_equal(results[name][setting], iso_actions, err_msg=f"{name} {setting}")
        np.testing.assert_array_equal(results[name]["iso_tokens"], results[name]["tokens"])
        np.testing.assert_array_equal(results[name]["par_tokens"], results[name]["tokens"])
    np.testing.assert_array_equal(results["zero"]["tokens"], results["none"]["tokens"])
    assert not np.array_equal(results["random"]["tokens"], results["none"]["tokens"])  # the adapter did act


def test_a_twenty_frame_rollout_has_the_same_actions_with_and_without_adapters(params, banks):
    frames = 20
    obs = jax.tree.map(lambda *x: jnp.stack(x), *[make_obs(params.config, batch=1, cameras=2, seed=50 + f)
                                                  for f in range(frames)])
    noise = jax.random.normal(jax.random.key(4), (frames, 1, HA, 32))
    arrivals = list(range(0, frames, 2))
    actions, tokens = {}, {}
    for name, bank in banks.items():
        adapters = [0] * len(arrivals) if bank is None else [i % 3 for i in range(len(arrivals))]
        table = schedule.make_request_table(arrivals, [N] * len(arrivals), stop_ids=[-1] * len(arrivals),
                                            adapters=adapters)
        pool = decode.init_pool(model.language_model(params), 3, model.prefix_length(params, jax.tree.map(lambda x: x[0], obs)), N)
        _, out = schedule.rollout(model.as_vla(params, 2), pool, obs, {"actions": noise}, table, bank, tokens_per_frame=2,
                                  admissions_per_frame=1)
        actions[name], tokens[name] = np.asarray(out.frames.actions["actions"]), np.asarray(out.frames.new_tokens)
    np.testing.assert_array_equal(actions["random"], actions["none"])
    np.testing.assert_array_equal(actions["zero"], actions["none"])
    np.testing.assert_array_equal(tokens["zero"], tokens["none"])
    assert not np.array_equal(tokens["random"], tokens["none"])


def test_engine_serves_adapters_by_name_and_refuses_unknown_ones(params, banks, obs):
    # The shapes of the settings test above: the engine reuses its compiled frame program.
    cfg = EngineConfig(num_slots=2, max_new_tokens=N, prompt_capacity=len(PROMPT), admissions_per_frame=2,
                       tokens_per_frame=2, action_horizon=HA)
    with pytest.raises(ValueError, match="bank stores 2"):
        Engine(as_vla(params, 2), cfg, bank=banks["random"], adapter_names=("memory",))
    eng = Engine(as_vla(params, 2), cfg, bank=banks["random"], adapter_names=("memory", "narration"))
    good = eng.submit(PROMPT, max_tokens=N, stop_ids=(), adapter="memory")
    with pytest.raises(RequestError, match="unknown adapter 'subtask'"):
        eng.submit(max_tokens=N, adapter="subtask")
    done = []
    for _ in range(3):
        done += eng.step(obs).finished
    assert [f.request_id for f in done] == [good]  # the refused request never disturbed the running one
    cache = model.prefill(params, obs)
    ref, _ = _pool_decode(params, cache, [0], [1], banks["random"])
    assert done[0].tokens == ref[0].tolist()
