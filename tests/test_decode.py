"""Language decoding and the unified-KV runtime: cached decode, slot pool, frames, settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import diverse_text_params, make_obs, recompute_greedy, shared_dir
from oxygen_jax.runtime import decode
from oxygen_jax.ckpts import hf as hf_checkpoint
from oxygen_jax.models.pi05 import model
from oxygen_jax.models import mot
from oxygen_jax.runtime import frame as schedule
from oxygen_jax.models.pi05.observation import Observation

HA = 4  # action horizon used throughout (tiny)


@pytest.fixture(scope="module")
def params(tiny_params):
    return diverse_text_params(tiny_params)


def _decode_alone(params, obs, row, budget, prompt=(), stop=-1, temperature=0.0, top_p=1.0, rid=0, q_cap=None):
    cache = model.prefill(params, obs)
    q_cap = len(prompt) if q_cap is None else q_cap
    pool = decode.init_pool(model.language_model(params), 1, cache.length, budget, q_cap)
    req = decode.make_requests(1, q_cap, [rid], rows=[row], prompts=[list(prompt)], budgets=[budget],
                               stop_ids=[stop], temperatures=[temperature], top_ps=[top_p])
    pool, _, _ = decode.admit(model.language_model(params), pool, cache, req)
    pool = decode.decode_to_completion(model.language_model(params), pool)
    return [int(t) for t in np.asarray(pool.tokens[0]) if t >= 0]


# --- cached decode against a full recompute ----------------------------------------------------


@pytest.mark.parametrize("prompt_attention", ["bidirectional", "causal"])
def test_cached_greedy_decode_equals_full_forward_recompute(params, prompt_attention):
    p = params.with_config(prompt_attention=prompt_attention)
    obs = make_obs(p.config, batch=2, cameras=2, lengths=[5, 9], image_masks=[[True, False], [True, True]])
    cache = model.prefill(p, obs)
    pool = decode.init_pool(model.language_model(p), 2, cache.length, 6)
    req = decode.make_requests(2, 0, [0, 1], rows=[0, 1], budgets=[6, 6], stop_ids=[-1, -1])
    pool, _, _ = decode.admit(model.language_model(p), pool, cache, req)
    logits = []
    for _ in range(5):
        pool, _, lg = decode.decode_step(model.language_model(p), pool)
        logits.append(np.asarray(lg))
    for row in range(2):
        ref_tokens, ref_logits = recompute_greedy(p, obs, 6, row=row)
        assert np.asarray(pool.tokens[row]).tolist() == ref_tokens
        assert len(set(ref_tokens)) > 2  # a meaningful sequence, not one repeated token
        np.testing.assert_allclose(np.stack(logits, 0)[:, row], ref_logits[1:], atol=2e-3, rtol=1e-4)


def test_request_prompts_continue_the_shared_prefix_causally(params):
    obs = make_obs(params.config, batch=1, cameras=2, lengths=[7], image_masks=[[True, False]])
    cache = model.prefill(params, obs)
    prompts = [[11, 12, 13], [40], []]
    pool = decode.init_pool(model.language_model(params), 3, cache.length, 5, prompt_len=4)
    req = decode.make_requests(3, 4, [0, 1, 2], prompts=prompts, budgets=[5, 5, 5], stop_ids=[-1] * 3)
    pool, _, _ = decode.admit(model.language_model(params), pool, cache, req)
    pool = decode.decode_to_completion(model.language_model(params), pool)
    for slot, prompt in enumerate(prompts):  # three language tasks share one observation prefix
        assert np.asarray(pool.tokens[slot]).tolist() == recompute_greedy(params, obs, 5, prompt=prompt)[0]


def test_masked_camera_gives_same_text_as_dropping_that_camera(params):
    obs = make_obs(params.config, batch=1, cameras=2, lengths=[8], image_masks=[[True, False]])
    dropped = Observation(obs.images[:, :1], obs.image_masks[:, :1], obs.tokens, obs.token_mask)
    assert _decode_alone(params, obs, 0, 6) == _decode_alone(params, dropped, 0, 6)


# --- sampling ----------------------------------------------------------------------------------


def test_sampled_tokens_depend_on_the_request_not_on_its_batch(params):
    obs = make_obs(params.config, batch=2, cameras=2)
    alone = _decode_alone(params, obs, 1, 6, temperature=1.5, rid=7)
    cache = model.prefill(params, obs)
    pool = decode.init_pool(model.language_model(params), 3, cache.length, 6)
    req = decode.make_requests(3, 0, [3, 7, 9], rows=[0, 1, 0], budgets=[6] * 3, stop_ids=[-1] * 3,
                               temperatures=[0.0, 1.5, 0.7])
    pool, _, _ = decode.admit(model.language_model(params), pool, cache, req)
    pool = decode.decode_to_completion(model.language_model(params), pool)
    assert np.asarray(pool.tokens[1]).tolist() == alone
    assert alone != _decode_alone(params, obs, 1, 6)  # temperature 1.5 is not greedy here


def test_tiny_top_p_keeps_only_the_top_token():
    from oxygen_jax.nn.sampling import sample_tokens

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4)
    got = sample_tokens(logits, jnp.full((4,), 2.0), jnp.full((4,), 1e-6), keys)
    np.testing.assert_array_equal(got, jnp.argmax(logits, -1))
    free = sample_tokens(logits, jnp.full((4,), 50.0), jnp.ones(4), keys)
    assert not np.array_equal(free, jnp.argmax(logits, -1))  # hot sampling without top-p wanders


# --- the slot pool across frames -----------------------------------------------------------------


def _frame_obs(cfg, frames):
    return [make_obs(cfg, batch=1, cameras=2, seed=100 + f, lengths=[4 + f % 5], image_masks=[[True, f % 3 != 1]])
            for f in range(frames)]


def test_continuous_batching_gives_each_request_its_single_request_tokens(params):
    frames, budget, k = 8, 7, 3  # budget % k != 0: a short final burst
    obs = _frame_obs(params.config, frames)
    noise = jax.random.normal(jax.random.key(0), (frames, 1, HA, 32))
    arrivals = [0, 0, 1, 2, 2, 2, 3, 5]  # 3 slots and 2 admissions per frame: some requests queue
    table = schedule.make_request_table(arrivals, [budget] * len(arrivals), stop_ids=[-1] * len(arrivals))
    pool = decode.init_pool(model.language_model(params), 3, model.prefix_length(params, obs[0]), budget)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *obs)
    _, out = schedule.rollout(model.as_vla(params, 2), pool, stacked, {"actions": noise}, table, tokens_per_frame=k,
                              admissions_per_frame=2)
    fr = jax.device_get(out.frames)
    tokens, admit_frame = {}, {}
    for f in range(frames):
        for j in range(int(fr.admitted[f].sum())):
            admit_frame[int(out.admitted_from[f]) + j] = f
        for slot, rid in enumerate(fr.request_id[f]):
            if rid >= 0:
                tokens.setdefault(int(rid), []).extend(int(t) for t in fr.new_tokens[f, slot] if t >= 0)
    assert sorted(tokens) == list(range(len(arrivals)))  # nobody dropped
    assert max(admit_frame[r] - arrivals[r] for r in tokens) > 0  # some request did wait in the queue
    for rid, toks in tokens.items():
        assert toks == _decode_alone(params, obs[admit_frame[rid]], 0, budget), rid
    # the actions of every frame are those of the plain sampler
    for f in range(frames):
        np.testing.assert_allclose(fr.actions["actions"][f], model.sample_actions(params, obs[f], noise[f], 2), atol=1e-5)


def test_actions_and_greedy_tokens_identical_in_all_four_settings(params):
    obs = make_obs(params.config, batch=1, cameras=2, image_masks=[[True, False]])
    noise = jax.random.normal(jax.random.key(5), (1, HA, 32))
    n, steps = 6, 3
    req = decode.make_requests(1, 0, [0], budgets=[n], stop_ids=[-1])
    vla, noises = model.as_vla(params, steps), {"actions": noise}
    iso_a = schedule.head_program(vla, "actions", obs, noises)
    iso_t, _ = schedule.text_program(vla, obs, req, max_new_tokens=n)
    sh_a, sh_t, _ = schedule.shared_kv_program(vla, obs, noises, req, max_new_tokens=n)
    par_a, par_t, _ = schedule.run_parallel(vla, obs, noises, req, max_new_tokens=n)
    pool = decode.init_pool(model.language_model(params), 2, model.prefill(params, obs).length, n)
    cb_tokens, cb_a = [], None
    for f in range(3):
        r = req if f == 0 else decode.make_requests(1, 0, [], budgets=[])
        pool, out = schedule.frame_step(vla, pool, obs, noises, r, tokens_per_frame=2)
        cb_a = cb_a if cb_a is not None else out.actions["actions"]
        cb_tokens += [int(t) for t in np.asarray(out.new_tokens[0]) if t >= 0]
    for a in (sh_a["actions"], par_a["actions"], cb_a):
        np.testing.assert_allclose(a, iso_a, rtol=0, atol=1e-6)
    expected = np.asarray(iso_t[0]).tolist()
    assert np.asarray(sh_t[0]).tolist() == expected == np.asarray(par_t[0]).tolist() == cb_tokens



# --- any backbone: Hugging Face Qwen3 / Qwen3-VL prefixes through the same pool -----------------


@pytest.mark.parametrize("fixture", ["qwen3_tiny", "qwen3vl_tiny"])
def test_pool_greedy_tokens_on_hf_qwen_prefixes_equal_transformers_generate(fixture):
    """The slot pool (admit, then k-token bursts) decodes a Qwen3 prefix (1-D RoPE, untied head) and a Qwen3-VL
    prefix (images, DeepStack, M-RoPE: decode positions = the row's next position + j on every axis), each with a
    left-padded row, to exactly the tokens of transformers' cached `generate` (fixtures made by transformers)."""
    path = shared_dir() / "fixtures" / fixture
    if not path.is_dir():
        pytest.skip(f"../shared fixtures not present: {path} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    ck = hf_checkpoint.load(path)
    ref = dict(np.load(path / "reference.npz"))
    spec = mot.ModelSpec(backbone=ck.spec, heads=(), image_token_id=ck.config.get("image_token_id"))
    params = mot.ModelParams(decoder=ck.decoder, vision=ck.vision, heads={})
    images = [ref[k] for k in sorted(k for k in ref if k.startswith("images_row"))]
    inputs = mot.make_inputs(spec, ref["input_ids"], ref["attention_mask"].astype(bool), images)
    prefix = jax.jit(mot.prefix_pass, static_argnums=0)(spec, params, inputs)
    lm = mot.language_model(spec, params)
    n = ref["gen_tokens"].shape[1]
    pool = decode.init_pool(lm, 3, decode.prefix_length(prefix), n)
    req = decode.make_requests(2, 0, [0, 1], rows=[0, 1], budgets=[n, n], stop_ids=[-1, -1])
    pool, _, first = decode.admit(lm, pool, prefix, req)
    pool, burst = decode.decode_burst(lm, pool, n - 1)
    got = np.concatenate([np.asarray(first)[:2, None], np.asarray(burst)[:2]], axis=1)
    np.testing.assert_array_equal(got, ref["gen_tokens"])
    if "decode_position_ids" in ref:  # generated token j sits at the row's next position + j (11.., 7..)
        np.testing.assert_array_equal(np.asarray(pool.base_position)[:2], ref["decode_position_ids"][:, 0])
