"""`Engine` drives any model: a Qwen3-VL backbone with XR0- and StarVLA-style heads and a language decoder.

The specification:

* every head's chunk from `Engine.step` is bit-identical to that head run alone (its own prefix pass keeping
  only its reads: `frame.head_program`), with language requests in flight; `actions` is the primary head's;
* a request's tokens are those it gets decoded alone from the same prefix (`frame.text_program`);
* noise and states are checked per head, with errors that name the head.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import mot_prompt_rows

from oxygen_jax.models import mot
from oxygen_jax.runtime import decode
from oxygen_jax.runtime import frame
from oxygen_jax.runtime.engine import Engine, EngineConfig
from oxygen_jax.models.vla import MultiHead

_ROWS, _MASK = mot_prompt_rows()
N = 5  # tokens per request
CFG = EngineConfig(num_slots=2, max_new_tokens=N, admissions_per_frame=2, tokens_per_frame=2)


def _images(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(3)]


@pytest.fixture(scope="module")
def model():
    full = mot.preset("tiny")
    spec = full.only(*[h.name for h in full.heads if h.kind != "cross_last"], language=True)  # XR0 + StarVLA
    assert {h.kind for h in spec.heads} == {"joint_kv", "cross_hidden"}
    return MultiHead(mot.init_model(spec, seed=0), spec)


def _states(vla: MultiHead, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((3, d)).astype(np.float32) for n, d in vla.state_dims().items()}


def _noises(vla: MultiHead, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((3, *vla.action_shape(n))).astype(np.float32) for n in vla.heads}


def test_every_heads_chunk_equals_that_head_alone_and_requests_equal_their_single_decode(model):
    eng = Engine(model, CFG)
    rid = eng.submit(max_tokens=N, stop_ids=(), row=1)
    finished, first = [], None
    for f in range(3):
        inputs = mot.make_inputs(model.spec, _ROWS, _MASK, _images(f))
        noises, states = _noises(model, f), _states(model, f)
        res = eng.step(inputs, noises, states=states)
        finished += res.finished
        assert set(res.head_actions) == set(model.heads)
        np.testing.assert_array_equal(res.actions, res.head_actions[model.primary])
        for name in model.heads:
            alone = np.asarray(frame.head_program(model, name, inputs, noises, states))
            np.testing.assert_array_equal(res.head_actions[name], alone, err_msg=f"frame {f} head {name}")
        if f == 0:
            first = inputs
            assert res.batch == 1  # the request was decoding in this frame
    (done,) = finished
    assert done.request_id == rid and done.admit_frame == 0
    req = decode.make_requests(1, 0, [0], rows=[1], budgets=[N], stop_ids=[-1])
    tokens, _ = frame.text_program(model, first, req, max_new_tokens=N)
    assert done.tokens == np.asarray(tokens[0]).tolist()


def test_default_noise_is_drawn_per_head_and_the_frame_compiles_once(model):
    eng = Engine(model, CFG)
    before = frame.frame_step._cache_size()
    for f in range(3):
        res = eng.step(mot.make_inputs(model.spec, _ROWS, _MASK, _images(10 + f)), states=_states(model, f))
        assert all(res.head_actions[n].shape == (3, *model.action_shape(n)) for n in model.heads)
        assert all(np.isfinite(a).all() for a in res.head_actions.values())
    assert frame.frame_step._cache_size() - before <= 1


def test_noise_and_states_are_checked_per_head(model):
    eng = Engine(model, CFG)
    inputs = mot.make_inputs(model.spec, _ROWS, _MASK, _images(0))
    states, noises = _states(model, 0), _noises(model, 0)
    with pytest.raises(ValueError, match="pass noise as a dict head name"):
        eng.step(inputs, noises[model.primary], states=states)
    with pytest.raises(ValueError, match="noise must name exactly the heads"):
        eng.step(inputs, {model.primary: noises[model.primary]}, states=states)
    name = next(iter(states))
    with pytest.raises(ValueError, match="states must name exactly the heads with a state token"):
        eng.step(inputs, noises)
    with pytest.raises(ValueError, match=rf"states\['{name}'\] must have shape"):
        eng.step(inputs, noises, states={**states, name: states[name][:, :1]})
    with pytest.raises(ValueError, match="takes mot.PrefixInputs"):
        eng.step(np.zeros((3, 12), np.int32), noises, states=states)
    assert eng.frame == 0  # nothing ran


def test_a_model_without_language_is_refused_by_the_engine_with_the_fix(model):
    alone = model.only(model.primary)
    with pytest.raises(ValueError, match="language=True"):
        Engine(alone, CFG)


def test_token_ids_outside_the_vocabulary_are_refused_where_the_rows_are_built(model):
    rows = _ROWS.copy()
    rows[0, 0] = model.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids must lie in \[0, {model.vocab_size}\)"):
        mot.make_inputs(model.spec, rows, _MASK, _images(0))
