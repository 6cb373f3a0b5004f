"""The host engine and its scheduler: queueing, streams, cancellation, and input that cannot stop the actions."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import diverse_text_params, make_obs
from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.runtime import decode
from oxygen_jax.models.pi05 import model
from oxygen_jax.runtime import frame as schedule
from oxygen_jax.runtime.engine import Engine, EngineConfig, RequestError

HA = 4
# One engine shape for most tests, so the frame program compiles once for the module.
CFG = EngineConfig(num_slots=2, max_new_tokens=6, prompt_capacity=2, admissions_per_frame=2, tokens_per_frame=2,
                   action_horizon=HA)


@pytest.fixture(scope="module")
def params(tiny_params):
    return diverse_text_params(tiny_params)


@pytest.fixture(scope="module")
def obs1(params):
    return make_obs(params.config, batch=1, cameras=2, lengths=[6])


@pytest.fixture(scope="module")
def obs2(params):
    return make_obs(params.config, batch=2, cameras=2, lengths=[6, 9], seed=3)


def _alone(params, obs, row, budget, stop=-1, prompt=()):
    """Reference: the request decoded alone in a one-slot pool, to completion."""
    cache = model.prefill(params, obs)
    pool = decode.init_pool(model.language_model(params), 1, cache.length, budget, len(prompt))
    req = decode.make_requests(1, len(prompt), [0], rows=[row], prompts=[list(prompt)], budgets=[budget],
                               stop_ids=[stop])
    pool, _, _ = decode.admit(model.language_model(params), pool, cache, req)
    pool = decode.decode_to_completion(model.language_model(params), pool)
    return [int(t) for t in np.asarray(pool.tokens[0]) if t >= 0]


def _run(eng, obs, frames, **kw):
    done, results = [], []
    for _ in range(frames):
        res = eng.step(obs, **kw)
        results.append(res)
        done += res.finished
    return done, results


def test_eos_finishes_a_request_and_frees_its_slot(params, obs1):
    free_run = _alone(params, obs1, 0, 6)
    stop = free_run[3]
    eng = Engine(as_vla(params, 1), CFG)
    eng.submit(max_tokens=6, stop_ids=[stop])
    done, _ = _run(eng, obs1, 4)
    assert len(done) == 1 and done[0].tokens == free_run[: free_run.index(stop) + 1]  # ends with the stop token
    assert eng.num_active == 0 and int(jnp.sum(eng._pool.request_id >= 0)) == 0


def test_requests_queue_when_all_slots_are_busy_and_none_is_dropped(params, obs1):
    eng = Engine(as_vla(params, 1), CFG)
    ids = [eng.submit(max_tokens=4, stop_ids=()) for _ in range(5)]
    done, results = _run(eng, obs1, 8)
    assert all(r.actions.shape == (1, HA, 32) for r in results)  # actions every frame, whatever the text load
    assert sorted(f.request_id for f in done) == ids
    assert results[0].queued == 3 and results[-1].queued == 0
    assert [f.request_id for f in sorted(done, key=lambda f: (f.admit_frame, f.request_id))] == ids  # FIFO
    # 4 tokens at k=2: token 0 at admission + 2 + 1 -> two frames per request
    assert all(len(f.tokens) == 4 and f.finish_frame - f.admit_frame == 1 for f in done)


def test_each_stream_gets_its_own_robots_tokens(params, obs2):
    """Two robots in one batch; a request on stream 7 waits while stream 7 is absent, then continues its robot."""
    eng = Engine(as_vla(params, 1), CFG)
    a = eng.submit(max_tokens=5, stop_ids=(), row=7)
    b = eng.submit(max_tokens=5, stop_ids=(), row=3)
    # Frame 0: only stream 3 is present (at batch row 1); the request on 7 must wait, not block b.
    r0 = eng.step(obs2, rows=[-1, 3])
    assert eng.num_queued == 1 and eng.num_active == 1 and r0.errors == []
    done, _ = _run(eng, obs2, 3, rows=[7, 3])
    done += r0.finished
    got = {f.request_id: f for f in done}
    assert got[b].tokens == _alone(params, obs2, 1, 5) and got[b].row == 3
    assert got[a].tokens == _alone(params, obs2, 0, 5) and got[a].row == 7


def test_cancel_frees_queued_and_running_requests(params, obs1):
    eng = Engine(as_vla(params, 1), CFG)
    running = eng.submit(max_tokens=6, stop_ids=())
    queued = [eng.submit(max_tokens=6, stop_ids=()) for _ in range(3)]
    eng.step(obs1)  # two admitted, two queued
    assert eng.num_active == 2
    assert eng.cancel(queued[2]) and eng.cancel(running)
    assert not eng.cancel(running) and not eng.cancel(12345)
    done, _ = _run(eng, obs1, 4)
    assert sorted(f.request_id for f in done) == queued[:2]  # the cancelled ones never report
    assert eng.num_active == eng.num_queued == 0


def test_requests_that_cannot_run_are_dropped_and_reported_while_actions_return(params, obs1):
    eng = Engine(as_vla(params, 1), CFG)
    bad = eng.submit(max_tokens=3, row=4)  # no stream 4 in a 1-row batch without explicit rows
    good = eng.submit(max_tokens=3, stop_ids=())
    res = eng.step(obs1)
    assert [e.request_id for e in res.errors] == [bad] and "row 4" in res.errors[0].reason
    assert np.isfinite(res.actions).all()
    done, _ = _run(eng, obs1, 2)
    assert [f.request_id for f in res.finished + done] == [good]


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=7), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
    (dict(prompt_tokens=[5, 6, 7], max_tokens=2), "prompt_capacity"),
    (dict(prompt_tokens=[1024], max_tokens=2), "token ids"), (dict(prompt_tokens=["a"], max_tokens=2), "prompt_tokens"),
    (dict(prompt="hello", max_tokens=2), "no tokenizer.*prompt_tokens"), (dict(max_tokens=2, temperature=float("nan")), "temperature"),
    (dict(max_tokens=2, temperature=-1), "temperature"), (dict(max_tokens=2, top_p=0), "top_p"),
    (dict(max_tokens=2, top_p="x"), "top_p"), (dict(max_tokens=2, stop_ids=[-2]), "stop_ids"), (dict(max_tokens=2, stop_ids=list(range(9))), "stop_ids"),
    (dict(max_tokens=2, seed=-1), "seed"), (dict(max_tokens=2, seed=2**40), "seed"), (dict(max_tokens=2, row=-1), "row"),
    (dict(max_tokens=2, adapter="memory"), "unknown adapter"), (dict(max_tokens=2, adapter=1), "adapter id"),
])
def test_every_request_field_is_checked_at_submit(params, kwargs, field):
    eng = Engine(as_vla(params, 1), CFG)
    with pytest.raises(RequestError, match=field) as exc:
        eng.submit(**kwargs)
    assert "\n" not in str(exc.value)
    assert eng.num_queued == 0  # nothing half-queued


def test_noise_is_checked_and_named_adapters_resolve(params, obs1):
    from oxygen_jax.models.pi05.lora import init_bank

    eng = Engine(as_vla(params, 1), CFG, bank=init_bank(params.config, 1, rank=2), adapter_names=("memory",))
    assert eng.adapter_id("memory") == 1 and eng.adapter_id("base") == 0 and eng.limits.adapters == ("base", "memory")
    with pytest.raises(ValueError, match="bank stores 0"):
        Engine(as_vla(params, 1), CFG, adapter_names=("memory",))  # names without a bank
    with pytest.raises(ValueError, match="shape"):
        eng.step(obs1, jnp.zeros((1, HA + 1, 32)))
    with pytest.raises(ValueError, match="NaN"):
        eng.step(obs1, jnp.full((1, HA, 32), jnp.nan))
    with pytest.raises(ValueError, match="floating"):
        eng.step(obs1, jnp.zeros((1, HA, 32), jnp.int32))
    with pytest.raises(ValueError, match="unique"):
        Engine(as_vla(params, 1), CFG, bank=init_bank(params.config, 1, rank=2), adapter_names=("base",))


def test_fifty_frames_with_changing_occupancy_compile_the_frame_once(params):
    before = schedule.frame_step._cache_size()
    cfg = EngineConfig(num_slots=5, max_new_tokens=6, admissions_per_frame=3, tokens_per_frame=2,
                       action_horizon=HA)  # sizes no other test uses: the compile is this test's own
    eng = Engine(as_vla(params, 1), cfg)
    rng = np.random.default_rng(0)
    obs = make_obs(params.config, batch=1, cameras=2)
    batches = set()
    for f in range(50):
        for _ in range(rng.poisson(0.9)):
            eng.submit(max_tokens=int(rng.integers(1, 7)), stop_ids=())
        if f == 20:
            eng.cancel(eng.requests_of(None)[-1])  # a cancellation is an array value too
        res = eng.step(dataclasses.replace(obs, image_masks=jnp.array([[True, f % 4 != 0]])))
        batches.add(res.batch)
    assert len(batches) >= 4  # occupancy really changed
    assert schedule.frame_step._cache_size() - before == 1


def test_scheduler_offers_fifo_per_stream_and_fixed_shapes():
    from oxygen_jax.runtime.scheduler import Scheduler, Ticket

    s = Scheduler(num_slots=3, admissions_per_frame=2, prompt_capacity=2)
    for rid, row in enumerate([5, 6, 5]):
        s.enqueue(Ticket.make(rid, budget=3, row=row, prompt=[9] if rid == 2 else []))
    req, evict = s.offer([6, -1])  # only stream 6 present, at batch row 0
    assert req.valid.tolist() == [True, False] and req.request_id[0] == 1 and req.row[0] == 0
    req, _ = s.offer([-1, 5])
    assert req.request_id.tolist() == [0, 2] and req.row.tolist() == [1, 1] and req.prompt_len.tolist() == [0, 1]
    assert req.prompt.shape == (2, 2) and evict.shape == (3,) and req.sampling.key.shape[0] == 2
    with pytest.raises(ValueError, match="capacity"):
        s.enqueue(Ticket.make(9, budget=1, prompt=[1, 2, 3]))


def test_a_frame_that_fails_with_requests_is_rerun_without_them(params, obs1, monkeypatch):
    from oxygen_jax.runtime import engine as engine_mod

    real = engine_mod.frame_step

    def failing_with_requests(params, pool, obs, noise, requests, *args, **kw):
        if np.any(requests.valid):
            raise RuntimeError("boom")
        return real(params, pool, obs, noise, requests, *args, **kw)

    monkeypatch.setattr(engine_mod, "frame_step", failing_with_requests)
    eng = Engine(as_vla(params, 1), CFG)
    rid = eng.submit(max_tokens=3)
    res = eng.step(obs1)
    assert [e.request_id for e in res.errors] == [rid] and "boom" in res.errors[0].reason
    assert res.actions.shape == (1, HA, 32) and np.isfinite(res.actions).all()
    assert eng.num_queued == eng.num_active == 0


def test_warmup_compiles_a_batch_shape_without_touching_requests(params):
    eng = Engine(as_vla(params, 1), CFG)
    rid = eng.submit(max_tokens=2)
    obs3 = make_obs(params.config, batch=3, cameras=2, seed=9)
    assert eng.warmup(obs3) > 0
    assert eng.num_queued == 1 and eng.frame == 0  # nothing admitted, no frame counted
    before = schedule.frame_step._cache_size()
    res = eng.step(obs3)
    assert schedule.frame_step._cache_size() == before  # already compiled
    assert [f.request_id for f in res.finished] == [rid]


def test_adapter_none_means_the_base_weights(params, obs1):
    eng = Engine(as_vla(params, 1), CFG)
    assert eng.adapter_id(None) == eng.adapter_id("base") == 0
    a = eng.submit(max_tokens=4, stop_ids=(), adapter=None)
    b = eng.submit(max_tokens=4, stop_ids=(), adapter="base")
    done, _ = _run(eng, obs1, 3)
    tokens = {f.request_id: f.tokens for f in done}
    assert tokens[a] == tokens[b] == _alone(params, obs1, 0, 4)
