"""Several heads on one shared prefix (mot.py): one prefix pass keeps the union of the reads, and a head's
actions do not depend on which other heads share the program.

One tiny Qwen3-VL model (images, DeepStack, M-RoPE) with an XR0-style, a QwenPI_v3-style and a GR00T-style
head plus a language decoder; three prompt rows: row 0 unpadded, row 1 left-padded, row 2 = row 1 with junk
token ids in its padded slots (same image, same noise and state).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mot_prompt_rows

from oxygen_jax.models import backbone as bb
from oxygen_jax.runtime import decode
from oxygen_jax.models import heads as hd
from oxygen_jax.models import mot
from oxygen_jax.nn.layers import param_count

_ROWS, _MASK = mot_prompt_rows()  # same shapes in test_mot and test_fanout: compiled programs are shared


@jax.jit
def _frame(params, spec, inputs, noises, states):
    """The shape of a fan-out frame program: one prefix pass, all heads, the prefix kept for language."""
    prefix = mot.prefix_pass(spec, params, inputs)
    return prefix, mot.run_heads(spec, params, prefix, noises, states)


@pytest.fixture(scope="module")
def tiny():
    spec = mot.preset("tiny")
    params = mot.init_model(spec, seed=0)
    rng = np.random.default_rng(0)
    image0, image1 = (rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(2))
    inputs = mot.make_inputs(spec, _ROWS, _MASK, [image0, image1, image1])

    def rows(shape):  # rows 1 and 2 share their draws
        x = rng.standard_normal((2,) + shape).astype(np.float32)
        return jnp.asarray(np.concatenate([x, x[1:]]))

    noises = {h.name: rows((h.horizon, h.action_dim)) for h in spec.heads}
    states = {h.name: rows((h.state_dim,)) for h in spec.heads if h.state_dim}
    prefix, actions = _frame(params, spec, inputs, noises, states)
    return dict(spec=spec, params=params, inputs=inputs, noises=noises, states=states, prefix=prefix, actions=actions)


def test_each_heads_actions_are_bit_identical_with_or_without_the_other_heads(tiny):
    """The fan-out program (3 heads + language on one prefix) against `sample_all` of a model holding only that
    head, which runs its own prefix pass keeping only its own reads (XR0: K/V of layers 1-2 instead of all;
    QwenPI_v3: hidden states 1-3 and no K/V; GR00T: hidden state 3 only)."""
    spec, params = tiny["spec"], tiny["params"]
    for name in spec.names:
        alone = mot.sample_all(params.only(name), spec.only(name), tiny["inputs"], {name: tiny["noises"][name]},
                               {k: s for k, s in tiny["states"].items() if k == name})
        assert set(alone) == {name}
        np.testing.assert_array_equal(alone[name], tiny["actions"][name], err_msg=name)
        assert np.all(np.isfinite(alone[name])) and not np.allclose(alone[name], tiny["noises"][name], atol=1e-2)
    assert not np.allclose(tiny["actions"]["xr0"][0], tiny["actions"]["xr0"][1], atol=1e-3)  # rows really differ


def test_padded_prefix_slots_are_invisible_to_every_head_and_to_the_language_reads(tiny):
    """Row 2 differs from row 1 only in token ids under its mask: same actions, same last hidden."""
    for name, actions in tiny["actions"].items():
        np.testing.assert_allclose(actions[2], actions[1], rtol=0, atol=1e-6, err_msg=name)
    prefix = tiny["prefix"]
    np.testing.assert_allclose(prefix.last_hidden[2], prefix.last_hidden[1], rtol=0, atol=1e-6)
    # Row 0: 3 text tokens (0-2), a 2x2-token image at 3 (h, w up to 4), 5 text tokens (5-9); padding takes none.
    np.testing.assert_array_equal(prefix.next_position, [10, 7, 7])


def test_prefix_pass_keeps_the_union_of_the_reads(tiny):
    spec, prefix = tiny["spec"], tiny["prefix"]
    assert spec.reads() == mot.PrefixReads((0, 1, 2), (1, 2, 3), True)
    assert (prefix.kv_layers, prefix.hidden_layers) == ((0, 1, 2), (1, 2, 3))
    chex.assert_shape([prefix.k, prefix.v], (3, 3, 12, 2, 16))
    chex.assert_shape(prefix.hidden, (3, 3, 12, 64))
    # HF index 3 is the final-normed output: the language decoder's last hidden is its last valid row.
    np.testing.assert_array_equal(prefix.hidden_states((3,))[0][:, -1], prefix.last_hidden)

    def kept(sub):
        out = jax.eval_shape(lambda p, i: mot.prefix_pass(sub, p, i), tiny["params"], tiny["inputs"])
        return out.kv_layers, out.hidden_layers, out.k is None, out.last_hidden is None

    assert kept(spec.only("xr0")) == ((1, 2), (), False, True)
    assert kept(spec.only("starvla_qwenpi_v3")) == ((), (1, 2, 3), True, True)
    assert kept(spec.only("gr00t")) == ((), (3,), True, True)
    assert kept(spec.only("gr00t", language=True)) == ((0, 1, 2), (3,), False, False)
    with pytest.raises(ValueError, match=r"the prefix kept the K/V of layers \(\), not \(1, 2\)"):
        hd.prepare(tiny["params"].heads["xr0"], spec.head("xr0"), jax.eval_shape(
            lambda p, i: mot.prefix_pass(spec.only("gr00t"), p, i), tiny["params"], tiny["inputs"]))


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_prefill_stores_only_the_read_layers_with_the_numbers_of_the_full_stack(tiny, layout):
    """`keep_kv` / `keep_hidden` change what the layer loop stores (a scan with traced layer indices, or the
    unrolled CPU loop), never a value: the kept K/V and HF hidden states are those of the full stack, in the asked
    order, with DeepStack and M-RoPE. (Across programs: `prefix_pass` against the full stack is bit-identical in
    test_each_heads_actions... and tests/test_fanout.py.)"""
    spec = tiny["spec"].backbone
    decoder = tiny["params"].decoder
    if layout == "unstacked":
        decoder = mot.for_backend(tiny["spec"], tiny["params"], "cpu").decoder
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 12, 64)), jnp.float32)
    deepstack = jnp.asarray(rng.standard_normal((2, 2, 12, 64)), jnp.float32)
    positions, mask = tiny["inputs"].positions[:, :2], tiny["inputs"].input_mask[:2]

    @jax.jit  # one program: the layer loop is what is under test, not XLA's choices between two programs
    def both(d):
        full = bb.prefill(spec, d, x, positions, mask, deepstack=deepstack, return_hidden=True)
        return full, bb.prefill(spec, d, x, positions, mask, deepstack=deepstack, keep_kv=(2, 0), keep_hidden=(3, 0, 2))

    full, kept = both(decoder)
    chex.assert_shape([kept["k"], kept["v"]], (2, 2, 12, 2, 16))
    for name in ("k", "v"):
        np.testing.assert_array_equal(kept[name], np.asarray(full[name])[[2, 0]])
    np.testing.assert_array_equal(kept["hidden_states"], np.asarray(full["hidden_states"])[[3, 0, 2]])
    np.testing.assert_array_equal(kept["normed"], full["normed"])
    with pytest.raises(ValueError, match=r"keep_hidden must be HF hidden-state indices in \[0, 3\], got \(4,\)"):
        bb.prefill(spec, decoder, x, positions, mask, keep_hidden=(4,))


def test_language_decoding_needs_a_prefix_with_every_layers_kv(tiny):
    spec, params = tiny["spec"], tiny["params"]
    xr0_only = jax.eval_shape(lambda p, i: mot.prefix_pass(spec.only("xr0"), p, i), params, tiny["inputs"])
    lm = mot.language_model(spec, params)
    pool = decode.init_pool(lm, 1, xr0_only.length, 4)
    req = decode.make_requests(1, 0, [0], budgets=[4])
    with pytest.raises(ValueError, match=r"prefix kept K/V of layers \(1, 2\): build it with a ModelSpec that has language=True"):
        decode.admit(lm, pool, xr0_only, req)
    with pytest.raises(ValueError, match="serves a models.decoder.LanguageDecoder .*got ModelParams"):
        decode.init_pool(params, 1, 12, 4)


def test_full_size_fan_out_frame_shapes_via_eval_shape():
    """Qwen3-VL-4B + XR0 + QwenPI_v3 + GR00T + language, a 256 x 256 image (64 tokens) in a 96-token prompt:
    traced, never allocated. The prefix keeps all 36 layers' K/V and hidden states 1..36 once for everyone."""
    spec = mot.preset("full")
    params = mot.abstract_model(spec, "bfloat16")
    assert param_count(params) == 4_437_815_808 + 278_458_368 + 630_087_687 + 161_472_775
    grid = ((1, 16, 16),)
    p = 96
    inputs = mot.PrefixInputs(
        input_ids=jax.ShapeDtypeStruct((1, p), jnp.int32), input_mask=jax.ShapeDtypeStruct((1, p), bool),
        positions=jax.ShapeDtypeStruct((3, 1, p), jnp.int32), next_position=jax.ShapeDtypeStruct((1,), jnp.int32),
        pixel_values=jax.ShapeDtypeStruct((256, 1536), jnp.bfloat16), grid=grid)
    noises = {h.name: jax.ShapeDtypeStruct((1, h.horizon, h.action_dim), jnp.float32) for h in spec.heads}
    states = {h.name: jax.ShapeDtypeStruct((1, h.state_dim), jnp.float32) for h in spec.heads if h.state_dim}
    prefix, actions = jax.eval_shape(_frame, params, spec, inputs, noises, states)
    chex.assert_shape([prefix.k, prefix.v], (36, 1, p, 8, 128))
    chex.assert_shape(prefix.hidden, (36, 1, p, 2560))
    chex.assert_shape(prefix.last_hidden, (1, 2560))
    assert {n: a.shape for n, a in actions.items()} == {"xr0": (1, 30, 32), "starvla_qwenpi_v3": (1, 16, 7), "gr00t": (1, 8, 7)}


def test_models_and_calls_reject_bad_input_in_one_line():
    tiny_backbone = mot.preset("tiny").backbone
    heads = mot.preset("tiny").heads
    cases = [
        (lambda: mot.ModelSpec(backbone=tiny_backbone, heads=heads + heads[:1], image_token_id=500), "distinct names"),
        (lambda: mot.ModelSpec(backbone=tiny_backbone, heads=heads), "image_token_id must be a token id < 512"),
        (lambda: mot.ModelSpec(backbone=tiny_backbone, heads=(), language=False, image_token_id=500), "at least one head"),
        (lambda: mot.preset("tiny").head("pi05"), "no head named 'pi05'"),
        (lambda: mot.preset("huge"), "unknown model preset 'huge'"),
        (lambda: mot.make_inputs(mot.preset("tiny"), _ROWS, _MASK[:, :5]), r"must both be \[B, P\]"),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            build()
        assert "\n" not in str(err.value)


def test_run_heads_needs_noise_for_exactly_its_heads(tiny):
    spec, params, prefix = tiny["spec"], tiny["params"], tiny["prefix"]
    with pytest.raises(ValueError, match=r"noises must be given for exactly the heads \('xr0', 'starvla_qwenpi_v3', 'gr00t'\)"):
        mot.run_heads(spec, params, prefix, {"xr0": tiny["noises"]["xr0"]})
    with pytest.raises(ValueError, match=r"no weights for heads \['gr00t'\]"):
        mot.run_heads(spec, params.only("xr0", "starvla_qwenpi_v3"), prefix, tiny["noises"])
