"""Speculative decoding (`runtime.speculative`) is exact: it changes how many steps text takes, never the text.

* Greedy: for every decoder kind (π0.5's Gemma as the attention decoder, Qwen3.5's hybrid whose carry must
  end at the last accepted token), a pool of requests on mixed adapters, with a stop id and short budgets,
  emits exactly the plain greedy tokens whether its drafts are all right, all wrong, partly right or absent;
  right drafts take fewer verify steps, and no request emits past its budget or its stop id.
* Sampling: the emitted tokens follow plain sampling's distribution (temperature and top-p): a two-sample
  chi-square over many seeds on the first three tokens does not reject equality at significance 0.001.
* Through `Engine`: actions are bit-identical with speculation on and off, a robot repeating a request
  drafts from its previous answer (more tokens per step), and the frame program compiles once; with a verify
  step charged 2 of a frame's 4 decode steps (`verify_cost`), a frame runs two verify steps or four decode steps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import diverse_text_params, make_obs
from oxygen_jax.models import mot
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.models.vla import MultiHead
from oxygen_jax.runtime import decode, frame, speculative
from oxygen_jax.runtime.draft_book import DraftBook
from oxygen_jax.runtime.engine import Engine, EngineConfig

Q, M, NS, G = 3, 10, 4, 3  # request-prompt capacity, new tokens, slots, γ (one pool shape per kind)
R = decode.draft_capacity(M, Q)


def _random_b(bank, seed: int, scale: float):
    """`bank` with random B factors (a fresh bank's B = 0 would make every adapter the base model)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype) if path[-1].name == "b" else x, bank)


def _dense(tiny_params):
    params = diverse_text_params(tiny_params)
    obs = make_obs(params.config, batch=2, cameras=2, lengths=[5, 7])
    bank = _random_b(pi05_lora.init_bank(params.config, 2, rank=2, seed=1), 2, 0.3)
    return as_vla(params).without_heads(), obs, bank


def _hybrid(_):
    spec = mot.preset("qwen35_tiny").only(language=True)
    vla = MultiHead(mot.init_model(spec, 2), spec)
    ids = np.random.default_rng(2).integers(4, 400, (2, 10)).astype(np.int32)
    inputs = mot.make_inputs(spec, ids, np.arange(10)[None] >= np.array([0, 3])[:, None])
    bank = qwen35.init_bank(vla.language().spec, 2, 2, seed=1, b_std=0.05)
    return vla, inputs, bank


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def kind(request, tiny_params):
    vla, inputs, bank = {"dense": _dense, "hybrid": _hybrid}[request.param](tiny_params)
    prefix = jax.jit(lambda v, x: v.prefix(x))(vla, inputs)
    return vla.language(), prefix, bank


def _requests(budgets, stops, ref=None, temperature=0.0, top_p=1.0, seeds=None, n=NS):
    req = decode.make_requests(n, Q, list(range(n)), rows=[i % 2 for i in range(n)],
                               prompts=[[11, 12], [40, 41, 42], [], [7]] * (n // 4), budgets=budgets,
                               stop_ids=stops, adapters=[0, 1, 2, 0] * (n // 4), temperatures=[temperature] * n,
                               top_ps=[top_p] * n, seeds=seeds)
    return dataclasses.replace(req, draft_ref=np.full((n, R), -1, np.int32) if ref is None else ref)


def _run(lm, prefix, bank, req, speculate: bool, slots=NS):
    """(tokens [Ns, M], verify or decode steps each slot took) from admission to completion."""
    pool = decode.init_pool(lm, slots, decode.prefix_length(prefix), M, Q, speculate=G)
    pool, _, _ = decode.admit(lm, pool, prefix, req, bank)
    burst = speculative.verify_burst if speculate else decode.decode_burst
    pool, toks = burst(lm, pool, M, bank)
    toks = np.asarray(toks).reshape(slots, M, -1)
    return np.asarray(pool.tokens), (toks >= 0).any(axis=2).sum(axis=1)


def _refs(answers: np.ndarray) -> np.ndarray:
    ref = np.full((answers.shape[0], R), -1, np.int32)
    ref[:, :M] = answers
    return ref


def test_draft_book_writes_the_previous_answer_then_recent_answers_then_the_prompt():
    book = DraftBook(16)
    assert book.reference(0, [7], 0).tolist() == [-1, 7, -1] + [-1] * 13  # nothing answered yet
    book.record(0, [7], 0, [1, 2, 3])
    book.record(0, [8], 0, [4, 5])
    book.record(1, [7], 0, [9])  # another robot
    book.record(0, [7], 1, [6])  # another adapter
    assert book.reference(0, [7], 0).tolist() == [1, 2, 3, -1, 6, -1, 4, 5, -1, 7, -1] + [-1] * 5
    assert book.reference(1, [7], 0).tolist()[:4] == [9, -1, 7, -1]
    assert DraftBook(4).reference(0, [7], 0).tolist() == [-1, 7, -1, -1]  # cut to the width


def test_drafts_continue_the_previous_answer_else_an_ngram_within_the_budget(dense):
    lm, prefix, _ = dense
    pool = decode.init_pool(lm, 5, decode.prefix_length(prefix), M, Q, speculate=G)
    ref = np.full((5, R), -1, np.int32)
    tokens = np.full((5, M), -1, np.int32)
    cases = [  # (reference, tokens so far, budget, active) -> draft
        ([5, 6, 7, 8, 9], [5, 6], M, True),  # agrees with the previous answer: its next tokens
        ([5, 6, 7, -1, 1, 2, 3, 4], [1, 2], M, True),  # disagrees: where "1 2" occurs in the reference
        ([5, 6, 7, 8, 9], [5, 6], 4, True),  # budget 4, 2 generated: at most 1 draft token
        ([], [9, 4, 1, 9, 4], M, True),  # no reference: where "9 4" occurred in its own tokens
        ([5, 6, 7, 8, 9], [5, 6], M, False),  # inactive: no draft
    ]
    for i, (r, t, _, _) in enumerate(cases):
        ref[i, :len(r)], tokens[i, :len(t)] = r, t
    pool = dataclasses.replace(
        pool, draft_ref=jnp.asarray(ref), tokens=jnp.asarray(tokens), active=jnp.asarray([c[3] for c in cases]),
        num_generated=jnp.asarray([len(c[1]) for c in cases], jnp.int32),
        sampling=dataclasses.replace(pool.sampling, budget=jnp.asarray([c[2] for c in cases], jnp.int32)))
    draft, length = jax.device_get(speculative.propose(pool))
    got = [draft[i, :n].tolist() for i, n in enumerate(length)]
    assert got == [[7, 8, 9], [3, 4], [7], [1, 9, 4], []]


def test_greedy_speculation_emits_the_plain_greedy_tokens_whatever_the_drafts(kind):
    lm, prefix, bank = kind
    budgets = [M, M, 5, M - 2]
    free, _ = _run(lm, prefix, bank, _requests(budgets, [-1] * NS), speculate=False)
    stop = int(free[1, 3])  # request 1 stops at its 4th token (earlier if that token came before)
    stops = [-1, stop, -1, -1]
    plain, plain_steps = _run(lm, prefix, bank, _requests(budgets, stops), speculate=False)
    assert len(set(plain[plain >= 0].tolist())) > 4  # not one repeated token
    lengths = np.array([M, int(np.argmax(free[1] == stop)) + 1, 5, M - 2])
    np.testing.assert_array_equal((plain >= 0).sum(axis=1), lengths)  # budgets and the stop id hold

    wrong = np.where(free >= 0, (free + 1) % lm.vocab_size, -1)
    partly = free.copy()
    partly[:, 2::3] = (partly[:, 2::3] + 1) % lm.vocab_size
    steps = {}
    for name, ref in [("none", None), ("right", _refs(free)), ("wrong", _refs(wrong)), ("partly", _refs(partly))]:
        tokens, steps[name] = _run(lm, prefix, bank, _requests(budgets, stops, ref), speculate=True)
        np.testing.assert_array_equal(tokens, plain, err_msg=f"drafts {name}")
    # Right drafts: γ + 1 tokens per verify step (budget - 1 tokens after admission); never more steps than plain.
    np.testing.assert_array_equal(steps["right"], -(-(lengths - 1) // (G + 1)))
    for name in steps:
        assert np.all(steps[name] <= plain_steps), name
    assert np.all(steps["partly"] < plain_steps)


@pytest.fixture(scope="module")
def dense(tiny_params):
    vla, inputs, bank = _dense(tiny_params)
    return vla.language(), jax.jit(lambda v, x: v.prefix(x))(vla, inputs), bank


def test_speculative_sampling_follows_the_plain_sampling_distribution(dense):
    from scipy import stats  # here, not at the top: every xdist worker imports this module to collect it (0.7 s)

    # The accept / reject rule does not depend on the decoder kind: the dense kind checks it.
    lm, prefix, bank = dense
    budget, rounds = 4, 64  # the greedy test's pool shape: its compiled programs, 256 draws per setting
    greedy, _ = _run(lm, prefix, bank, _requests([budget] * NS, [-1] * NS), speculate=False)
    # NS copies of request 0 (temperature 0.2, top-p 0.9: its first tokens have 2-4 likely values), drafting
    # its greedy answer: likely tokens, so drafts are accepted about half the time and the residual matters.
    ref = _refs(np.tile(greedy[:1], (NS, 1)))
    draws = {}
    for speculate in (False, True):
        rows = []
        for r in range(rounds):
            req = decode.make_requests(NS, Q, list(range(NS)), prompts=[[11, 12]] * NS, budgets=[budget] * NS,
                                       temperatures=[0.2] * NS, top_ps=[0.9] * NS, seeds=range(r * NS, (r + 1) * NS))
            tokens, _ = _run(lm, prefix, bank, dataclasses.replace(req, draft_ref=ref), speculate)
            rows.append(tokens[:, :3])
        draws[speculate] = np.concatenate(rows)
    # Two-sample chi-square on the joint of tokens 0..2 (outcomes seen fewer than 10 times pooled into one).
    a, b = draws[False], draws[True]
    cats, index = np.unique(np.concatenate([a, b]), axis=0, return_inverse=True)
    ca, cb = (np.bincount(i.ravel(), minlength=len(cats)) for i in (index[: len(a)], index[len(a):]))
    rare = (ca + cb) < 10
    table = np.stack([np.append(ca[~rare], ca[rare].sum()), np.append(cb[~rare], cb[rare].sum())])
    table = table[:, table.sum(axis=0) > 0]
    assert table.shape[1] >= 4, f"too few outcomes for a meaningful test: {table}"
    accepted = np.mean(b[:, 1] == greedy[0, 1])
    assert 0.2 < accepted < 0.9, accepted  # both branches of the rule ran
    assert stats.chi2_contingency(table).pvalue > 1e-3, table


def test_engine_actions_are_bit_identical_and_repeated_requests_draft_from_the_last_answer(tiny_params):
    params = diverse_text_params(tiny_params)
    vla = as_vla(params, 1)
    obs = make_obs(params.config, batch=1, cameras=2, lengths=[6])
    cfg = EngineConfig(num_slots=2, max_new_tokens=8, prompt_capacity=2, admissions_per_frame=1, tokens_per_frame=4,
                       action_horizon=4)
    runs = {}
    for gamma in (0, 3):  # the speculative engine charges a verify step 2 of the frame's 4 decode steps
        engine = Engine(vla, dataclasses.replace(cfg, speculate=gamma, verify_cost=2.0 if gamma else 1.0))
        compiled = frame.frame_step._cache_size()
        frames = []
        for f in range(6):  # the same memory request every frame (greedy: the same answer every time)
            engine.submit(prompt_tokens=[11, 12], max_tokens=8, stop_ids=())
            frames.append(engine.step(obs))
        runs[gamma] = frames
        assert frame.frame_step._cache_size() == compiled + 1, "the frame program compiled more than once"
    plain, spec = runs[0], runs[3]
    for p, s in zip(plain, spec):
        np.testing.assert_array_equal(p.actions, s.actions)  # bit for bit
    answers = lambda frames: [r.tokens for f in frames for r in f.finished]  # noqa: E731
    assert answers(spec)[: len(answers(plain))] == answers(plain) and len(set(map(tuple, answers(plain)))) == 1
    assert max(f.tokens_per_step for f in plain) == 1.0
    assert max(f.tokens_per_step for f in spec) > 2.0  # later requests draft the robot's previous answer
    assert [f.steps for f in plain] == [4] * 6
    assert spec[0].steps == 4 and max(f.steps for f in spec if f.tokens_per_step > 1) == 2  # charged 1, one ran 3
    latency = lambda frames: [r.latency_frames for f in frames for r in f.finished]  # noqa: E731
    assert len(latency(spec)) > len(latency(plain)) and np.mean(latency(spec)) < np.mean(latency(plain))


@pytest.mark.parametrize("command", ["serve", "run"])
def test_serve_and_run_take_speculate_as_a_non_negative_gamma(command):
    import importlib

    parser = importlib.import_module(f"oxygen_jax.{command}")._parser
    assert parser().parse_args([]).speculate == 0
    assert parser().parse_args(["--speculate", "4"]).speculate == 4
    with pytest.raises(SystemExit):
        parser().parse_args(["--speculate", "-1"])
    assert parser().parse_args([]).verify_cost == 1.0
    assert parser().parse_args(["--speculate", "3", "--verify-cost", "1.66"]).verify_cost == 1.66
    with pytest.raises(SystemExit):
        parser().parse_args(["--verify-cost", "0.5"])  # a verify step costs at least one decode step
    with pytest.raises(ValueError, match="speculate"):
        EngineConfig(speculate=-1)
    with pytest.raises(ValueError, match="verify_cost"):
        EngineConfig(speculate=2, verify_cost=0.5)
    with pytest.raises(ValueError, match="verify_cost"):
        EngineConfig(speculate=2, verify_cost=float("nan"))  # NaN compares False with everything


def test_a_burst_marks_the_drafts_it_rejected_so_the_host_counts_proposed_and_accepted(dense):
    lm, prefix, bank = dense  # the greedy test's pool shape: its compiled programs
    assert speculative.draft_counts(np.array([[5, 6, -2, -2, 7, -1, -1, -1]]), 3) == (3, 1)  # the docstring's steps
    free, _ = _run(lm, prefix, bank, _requests([M] * NS, [-1] * NS), speculate=False)
    counts = {}
    for name, ref in [("right", _refs(free)), ("wrong", _refs(np.where(free >= 0, (free + 1) % lm.vocab_size, -1)))]:
        pool = decode.init_pool(lm, NS, decode.prefix_length(prefix), M, Q, speculate=G)
        pool, _, _ = decode.admit(lm, pool, prefix, _requests([M] * NS, [-1] * NS, ref), bank)
        pool, toks = speculative.verify_burst(lm, pool, M, bank)
        np.testing.assert_array_equal(np.asarray(pool.tokens), free, err_msg=name)
        counts[name] = speculative.draft_counts(np.asarray(toks), G)
    # Right drafts: every draft accepted; each slot emits its M - 1 burst tokens in ceil((M - 1) / (γ + 1)) steps.
    steps = -(-(M - 1) // (G + 1))
    assert counts["right"] == (NS * (M - 1 - steps),) * 2
    proposed, accepted = counts["wrong"]
    assert proposed > accepted  # the previous answer's first token is wrong: its draft is rejected


def test_a_stop_id_inside_an_accepted_draft_counts_as_an_accepted_draft(dense):
    # Right drafts; request 0 stops at its token 2, the draft's second entry of its first verify step: it emits
    # drafts d_0 and d_1 (the stop), never its own token, so 3 proposed and 2 accepted. The others run as above.
    lm, prefix, bank = dense  # the greedy test's pool shape: its compiled programs
    assert speculative.draft_counts(np.array([[5, 6, -3, -2]]), 3) == (3, 2)  # the docstring's stop
    free, _ = _run(lm, prefix, bank, _requests([M] * NS, [-1] * NS), speculate=False)
    stop = int(free[0, 2])
    assert stop not in free[0, :2], "the tiny model repeats itself: choose another token"
    pool = decode.init_pool(lm, NS, decode.prefix_length(prefix), M, Q, speculate=G)
    pool, _, _ = decode.admit(lm, pool, prefix, _requests([M] * NS, [stop, -1, -1, -1], _refs(free)), bank)
    pool, toks = speculative.verify_burst(lm, pool, M, bank)
    np.testing.assert_array_equal(np.asarray(pool.tokens)[0], np.where(np.arange(M) < 3, free[0], -1))
    others = (NS - 1) * (M - 1 - -(-(M - 1) // (G + 1)))
    assert speculative.draft_counts(np.asarray(toks), G) == (3 + others, 2 + others)
