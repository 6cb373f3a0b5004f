"""openpi's arithmetic on π0.5's VLM expert at any width, in both checkpoint layouts, LoRA merged and per slot.

Two references, neither made with our code:

* `_openpi_forward`: openpi's `gemma.py` / `lora.py` arithmetic restated in numpy, dtype by dtype: the
  embedder scales the table by sqrt(D) rounded to the table's stored dtype (bfloat16 in the training layout:
  6.9375 for D = 48, float32 in the released one: 6.9282), the bfloat16 x bfloat16 product being exact in
  float32; RMSNorm takes the variance in float32 and multiplies by `1 + scale` in float32 (under `jit` XLA
  drops the bfloat16 round trip of `1 + scale`); RoPE angles are position / timescale correctly rounded to
  float32; LoRA is added after the base projection, `s * (x A) B` on attention (attn_vec's B summed over
  heads) and unscaled on the MLP. Everything else runs in float64, so the remaining difference is our
  float32 rounding.
* `tests/data/openpi_refs/width{48,72}.npz`: the outputs of openpi's own code (`eval/refs/openpi_refs.py`, jax 0.5.3
  on CPU) with their weights; loaded here through our openpi checkpoint loader in both layouts.

Widths are swept over ones whose square root is not a bfloat16 number (48 and 72, the stored references' widths)
and one that is (64, where the two layouts compute the same and the shared fixtures could not tell them apart).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from oxygen_jax.ckpts.openpi import load_openpi_lora, load_openpi_params
from oxygen_jax.models import backbone as bb
from oxygen_jax.models import lora as ll
from oxygen_jax.models.pi05 import lora as pi05_lora
from oxygen_jax.models.pi05.config import ExpertConfig, ModelConfig
from oxygen_jax.models.pi05.model import vlm_decoder
from oxygen_jax.models.pi05.params import init_params, to_openpi_dict
from oxygen_jax.models.pi05.spec import gemma_spec, pi05_spec
from oxygen_jax.models.vision.siglip import SiglipConfig
from oxygen_jax.nn.layers import RMSNorm

REFS = Path(__file__).parent / "data" / "openpi_refs"
L = "layers/"  # openpi paths below PaliGemma/llm/
# Of max|ref|, float32 against float64 rounding of a 2-layer stack with sharp attention: per slot the LoRA term
# is added as openpi adds it (measured <= 1.3e-5); merged weights round x (W + A B) instead of x W + (x A) B
# (<= 1.5e-5). What this guards against is far larger: sqrt(D) in the wrong dtype 3e-3..7e-3, 1 + scale rounded
# to bfloat16 ~1e-2. RoPE angles through the rounded reciprocal (2e-5..6e-5 here) are checked exactly by
# `test_rope_angles_of_pi05_are_correctly_rounded_quotients_at_any_position`.
RTOL = {"slot": 2e-5, "merged": 3e-5}


def _bf16(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


# --------------------------------------------------------------------------------------------------
# openpi's arithmetic, restated


def _norm(x, scale):
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(var + 1e-6) * (1.0 + scale.astype(np.float64))


def _rope(x, pos, head_dim):
    timescale = (10_000.0 ** ((2.0 / head_dim) * np.arange(head_dim // 2))).astype(np.float32)
    radians = (pos.astype(np.float32)[..., None] / timescale).astype(np.float64)[..., None, :]  # float32 quotient
    x1, x2 = np.split(x, 2, axis=-1)
    sin, cos = np.sin(radians), np.cos(radians)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _layer(w, i, x, pos, mask, s, cache=None):
    """One openpi Block with LoRA active on x [B, T, D]; `cache` = this layer's (k, v) attended before x's own."""
    g = lambda p: w[L + p][i].astype(np.float64)  # noqa: E731
    lora = lambda p, x, eq_a, eq_b: np.einsum(eq_b, np.einsum(eq_a, x, g(p + "/lora_a")), g(p + "/lora_b"))  # noqa: E731
    h = _norm(x, g("pre_attention_norm/scale"))
    q = np.einsum("BTD,NDH->BTNH", h, g("attn/q_einsum/w")) + s * lora("attn/q_einsum", h, "BTD,NDr->BTNr", "BTNr,NrH->BTNH")
    kv = np.einsum("BSD,CKDH->CBSKH", h, g("attn/kv_einsum/w"))
    kv = kv + s * lora("attn/kv_einsum", h, "BSD,CKDr->CBSKr", "CBSKr,CKrH->CBSKH")
    hd = q.shape[-1]
    q = _rope(q, pos, hd) * hd ** -0.5
    k, v = _rope(kv[0], pos, hd), kv[1]
    new = (k, v)
    if cache is not None:
        k, v = np.concatenate([cache[0], k], 1), np.concatenate([cache[1], v], 1)
    b, t, n, _ = q.shape
    qg = q.reshape(b, t, k.shape[2], n // k.shape[2], hd)
    logits = np.where(mask[:, None, None], np.einsum("BTKGH,BSKH->BKGTS", qg, k), -2.3819763e38)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    a = np.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(b, t, n, hd)
    o = np.einsum("BTNH,NHD->BTD", a, g("attn/attn_vec_einsum/w"))
    x = x + o + s * lora("attn/attn_vec_einsum", a, "BTNH,NHr->BTr", "BTr,NrD->BTD")  # B summed over heads
    h = _norm(x, g("pre_ffw_norm/scale"))
    gate, up = (h @ g("mlp/gating_einsum")[c] + (h @ g("mlp/gating_einsum_lora_a")[c]) @ g("mlp/gating_einsum_lora_b")[c]
                for c in (0, 1))  # feed-forward LoRA: unscaled
    act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
    return x + act @ g("mlp/linear") + (act @ g("mlp/linear_lora_a")) @ g("mlp/linear_lora_b"), new


def _openpi_forward(w, inputs, training: bool, scaling: float):
    """openpi's VLM expert (LoRA active, attention LoRA scaled by `scaling`) on a bidirectional prompt, then one
    decode step on its cache. Returns {embed, k, v ([L, B, T, K, H]), normed, logits, step_k, step_v, step_normed}."""
    tokens, pos, mask = inputs["tokens"], inputs["positions"], inputs["mask"]
    table = w["embedder/input_embedding"]
    d = table.shape[1]
    factor = np.float32(_bf16(math.sqrt(d)) if training else np.sqrt(np.float32(d)))  # sqrt(D).astype(table dtype)
    embed = lambda t: table[t] * factor  # noqa: E731  a bfloat16 x bfloat16 product is exact in float32
    x, ks, vs = embed(tokens).astype(np.float64), [], []
    depth = w[L + "attn/q_einsum/w"].shape[0]
    for i in range(depth):
        x, (k, v) = _layer(w, i, x, pos, mask[:, None, :] & mask[:, :, None], scaling)
        ks.append(k), vs.append(v)
    normed = _norm(x, w["final_norm/scale"])
    sx = embed(inputs["step_token"]).astype(np.float64)
    smask = np.concatenate([mask, np.ones_like(mask[:, :1])], 1)[:, None, :]
    sks, svs = [], []
    for i in range(depth):
        sx, (k, v) = _layer(w, i, sx, inputs["step_position"], smask, scaling, cache=(ks[i], vs[i]))
        sks.append(k), svs.append(v)
    return dict(embed=embed(tokens), k=np.stack(ks), v=np.stack(vs), normed=normed, logits=normed @ table.T.astype(np.float64),
                step_k=np.stack(sks), step_v=np.stack(svs), step_normed=_norm(sx, w["final_norm/scale"]))


# --------------------------------------------------------------------------------------------------
# Ours


def _ours(spec, decoder, rows, inputs):
    """The same quantities through `backbone`: the prompt by `forward_prefill` (merged weights, as π0.5's prefix
    runs) or `forward_write` with per-row adapters (`rows`, the decode pool's path), then one `forward_write` step."""
    tokens, pos, mask = inputs["tokens"], inputs["positions"], inputs["mask"]
    b, t = tokens.shape
    x = bb.embed_tokens(spec, decoder, tokens)
    attn = mask[:, None, :] & mask[:, :, None]
    cache = jnp.zeros((spec.depth, b, t + 1, spec.num_kv_heads, spec.head_dim), jnp.float32)
    if rows is None:
        hidden, (k, v) = bb.forward_prefill(spec, decoder.layers, x, pos, attn)
        ck, cv = cache.at[:, :, :t].set(k), cache.at[:, :, :t].set(v)
    else:
        slots = jnp.concatenate([attn, jnp.zeros((b, t, 1), bool)], -1)
        hidden, (ck, cv) = bb.forward_write(spec, decoder.layers, x, pos, slots, cache, cache,
                                            jnp.broadcast_to(jnp.arange(t), (b, t)), lora=rows)
    normed = bb.final_norm(spec, decoder, hidden)
    smask = jnp.concatenate([mask, jnp.ones((b, 1), bool)], 1)[:, None, :]
    sh, (sk, sv) = bb.forward_write(spec, decoder.layers, bb.embed_tokens(spec, decoder, inputs["step_token"]),
                                    inputs["step_position"], smask, ck, cv, jnp.full((b, 1), t), lora=rows)
    return dict(embed=x, k=ck[:, :, :t], v=cv[:, :, :t], normed=normed, logits=bb.lm_logits(spec, decoder, normed),
                step_k=sk[:, :, t:], step_v=sv[:, :, t:], step_normed=bb.final_norm(spec, decoder, sh))


_ours_jit = jax.jit(_ours, static_argnums=0)


def _assert_matches(ours, want, mask, rtol):
    """Embeddings bit for bit; the rest within `rtol` of max|ref|, compared on valid prompt rows."""
    for name, ref in want.items():
        got, ref = np.asarray(ours[name], np.float64), np.asarray(ref, np.float64)
        if name in ("k", "v"):
            got, ref = np.moveaxis(got, 0, 2), np.moveaxis(ref, 0, 2)  # [B, T, L, K, H]
        if not name.startswith("step"):
            got, ref = got[mask], ref[mask]
        if name == "embed":
            np.testing.assert_array_equal(got, ref.astype(np.float32), err_msg=name)
        else:
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err <= rtol, f"{name}: max |ours - openpi| / max |openpi| = {err:.3g} > {rtol:g}"


# --------------------------------------------------------------------------------------------------
# Weights as openpi lays them out (paths below PaliGemma/llm/), and our trees over the same arrays


def _openpi_shapes(d, depth, f, n, k, h, v, r) -> dict[str, tuple[int, ...]]:
    shapes = {"embedder/input_embedding": (v, d), "final_norm/scale": (d,)}
    for name, w, a, b in (("attn/q_einsum", (n, d, h), (n, d, r), (n, r, h)),
                          ("attn/kv_einsum", (2, k, d, h), (2, k, d, r), (2, k, r, h)),
                          ("attn/attn_vec_einsum", (n, h, d), (n, h, r), (n, r, d))):
        shapes.update({f"{L}{name}/w": (depth,) + w, f"{L}{name}/lora_a": (depth,) + a, f"{L}{name}/lora_b": (depth,) + b})
    for name, w, a, b in (("mlp/gating_einsum", (2, d, f), (2, d, r), (2, r, f)), ("mlp/linear", (f, d), (f, r), (r, d))):
        shapes.update({L + name: (depth,) + w, f"{L}{name}_lora_a": (depth,) + a, f"{L}{name}_lora_b": (depth,) + b})
    shapes.update({f"{L}pre_attention_norm/scale": (depth, d), f"{L}pre_ffw_norm/scale": (depth, d)})
    return shapes


def _random_expert(width: int, seed: int = 0, rank: int = 4) -> dict[str, np.ndarray]:
    """Random VLM-expert leaves: frozen ones (no "lora" in the path) rounded to bfloat16 values, norm scales
    N(0, 0.3) so that 1 + scale is not a bfloat16 number, sharp attention (q, K x3), a LoRA update about half W."""
    depth, f, n, k, h, v = 2, 2 * width, 2, 1, 8, 64
    out = {}
    for i, (path, shape) in enumerate(sorted(_openpi_shapes(width, depth, f, n, k, h, v, rank).items())):
        z = np.random.default_rng([seed, width, i]).standard_normal(shape)
        if path.endswith("scale"):
            w = 0.3 * z
        elif path.startswith("embedder"):
            w = 0.15 * z
        elif "lora_b" in path:
            w = z * np.sqrt(0.25 / rank)
        else:
            w = z / np.sqrt(n * h if "attn_vec" in path else f if "linear" in path else width)
            if path == L + "attn/q_einsum/w":
                w *= 3
            if path == L + "attn/kv_einsum/w":
                w[:, 0] *= 3  # K
        out[path] = (w if "lora" in path else _bf16(w)).astype(np.float32)
    return out


def _inputs(vocab: int, seed: int = 1, batch: int = 2, t: int = 12, offset: int = 800) -> dict[str, np.ndarray]:
    """A prompt per row at positions from `offset` (after ~800 image tokens; row 1 has 4 padding tokens)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, t), bool)
    mask[1, t - 4:] = False
    return dict(tokens=rng.integers(3, vocab, (batch, t)).astype(np.int32), mask=mask,
                positions=(offset + np.cumsum(mask, 1) - 1).astype(np.int32),
                step_token=rng.integers(3, vocab, (batch, 1)).astype(np.int32),
                step_position=(offset + mask.sum(1, keepdims=True)).astype(np.int32))


def _decoder(w) -> bb.Decoder:
    a = lambda p: jnp.asarray(w[L + p])  # noqa: E731
    layers = bb.DecoderLayers(q=a("attn/q_einsum/w"), kv=a("attn/kv_einsum/w"), out=a("attn/attn_vec_einsum/w"),
                              attn_norm=RMSNorm(scale=a("pre_attention_norm/scale")),
                              ffw_norm=RMSNorm(scale=a("pre_ffw_norm/scale")), gating=a("mlp/gating_einsum"),
                              linear=a("mlp/linear"))
    return bb.Decoder(embedding=jnp.asarray(w["embedder/input_embedding"]), layers=layers,
                      final_norm=RMSNorm(scale=jnp.asarray(w["final_norm/scale"])))


def _adapter(w, alpha: float) -> ll.ExpertLora:
    pair = lambda p, sep="/": ll.LoraPair(a=jnp.asarray(w[f"{L}{p}{sep}lora_a"]), b=jnp.asarray(w[f"{L}{p}{sep}lora_b"]))  # noqa: E731
    return ll.ExpertLora(q=pair("attn/q_einsum"), kv=pair("attn/kv_einsum"), out=pair("attn/attn_vec_einsum"),
                         gating=pair("mlp/gating_einsum", "_"), linear=pair("mlp/linear", "_"), alpha=alpha)


def _rows(adapter: ll.ExpertLora, batch: int) -> ll.RowAdapters:
    """Every row on bank adapter 1 (the decode pool's per-slot path)."""
    bank = ll.LoraBank(adapters=jax.tree.map(lambda x: x[:, None], adapter))
    return ll.RowAdapters(bank=bank, ids=jnp.ones((batch,), jnp.int32))


# --------------------------------------------------------------------------------------------------
# The specification


@pytest.mark.parametrize("head_dim", [8, 16, 256])
def test_rope_angles_of_pi05_are_correctly_rounded_quotients_at_any_position(head_dim):
    spec = pi05_spec(ModelConfig(vlm=ExpertConfig(width=48, depth=1, mlp_dim=8, num_heads=1, num_kv_heads=1, head_dim=head_dim),
                                 action_expert=ExpertConfig(width=32, depth=1, mlp_dim=8, num_heads=1, num_kv_heads=1,
                                                            head_dim=head_dim),
                                 siglip=SiglipConfig(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=14, image_size=28)))
    positions = jnp.arange(16_384, dtype=jnp.int32).reshape(2, -1)
    timescale = (10_000.0 ** ((2.0 / head_dim) * np.arange(head_dim // 2))).astype(np.float32)
    want = np.asarray(positions, np.float32)[..., None] / timescale  # IEEE float32 division
    ours = jax.jit(bb.rope_angles, static_argnums=(0, 2))(spec.rope, positions, head_dim)
    np.testing.assert_array_equal(np.asarray(ours), want)


@pytest.mark.parametrize("width", [48, 64, 72])
def test_vlm_expert_matches_openpis_arithmetic_in_both_layouts_with_lora_merged_and_per_slot(width):
    w, inputs = _random_expert(width), _inputs(64)
    decoder, adapter = _decoder(w), _adapter(w, alpha=8.0)  # rank 4: attention LoRA scaled by 2, MLP LoRA by 1
    merged = bb.Decoder(embedding=decoder.embedding, layers=ll.merge_layers(decoder.layers, adapter),
                        final_norm=decoder.final_norm)
    expert = ExpertConfig(width=width, depth=2, mlp_dim=2 * width, num_heads=2, num_kv_heads=1, head_dim=8)
    x = {k: jnp.asarray(v) for k, v in inputs.items()}
    for training in (False, True):
        want = _openpi_forward(w, inputs, training, scaling=2.0)
        spec = gemma_spec(expert, vocab_size=64, embed_scale_dtype="bfloat16" if training else None)
        _assert_matches(_ours_jit(spec, merged, None, x), want, inputs["mask"], RTOL["merged"])
        _assert_matches(_ours_jit(spec, decoder, _rows(adapter, 2), x), want, inputs["mask"], RTOL["slot"])


# --------------------------------------------------------------------------------------------------
# openpi's own outputs (tests/data/openpi_refs), through our checkpoint loader


def _stored_refs():
    return sorted(REFS.glob("width*.npz"))


@pytest.fixture(scope="module", params=_stored_refs(), ids=lambda p: p.stem)
def openpi_ref(request):
    ref = dict(np.load(request.param))
    meta = json.loads(str(ref.pop("meta")))
    return meta, {k[2:]: v for k, v in ref.items() if k.startswith("w/")}, ref


def test_the_stored_references_are_openpi_outputs_at_widths_whose_square_root_is_not_a_bfloat16_number():
    widths = [json.loads(str(np.load(p)["meta"]))["width"] for p in _stored_refs()]
    assert len(widths) >= 2 and all(_bf16(math.sqrt(d)) != np.float32(math.sqrt(d)) for d in widths), widths


def test_the_numpy_restatement_reproduces_openpis_own_outputs(openpi_ref):
    meta, w, ref = openpi_ref
    inputs = {k: ref[k] for k in ("tokens", "mask", "positions", "step_token", "step_position")}
    for layout in ("released", "training"):
        want = {k.split("/", 1)[1]: v for k, v in ref.items() if k.startswith(layout + "/")}
        _assert_matches(_openpi_forward(w, inputs, layout == "training", scaling=1.0), want, inputs["mask"], 1e-5)


def _write_checkpoints(root: Path, meta, w) -> Path:
    """A π0.5 checkpoint in both of openpi's layouts around the stored VLM expert (the action expert, SigLIP and
    projections random): `params/` float32, `train/params/` with `value` keys and the frozen VLM leaves bfloat16."""
    e = dict(depth=meta["depth"], num_heads=meta["num_heads"], num_kv_heads=meta["num_kv_heads"], head_dim=meta["head_dim"])
    config = ModelConfig(vlm=ExpertConfig(width=meta["width"], mlp_dim=meta["mlp_dim"], **e),
                         action_expert=ExpertConfig(width=32, mlp_dim=64, **e), vocab_size=meta["vocab"],
                         siglip=SiglipConfig(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=14, image_size=28))
    flat = {k: np.asarray(v) for k, v in to_openpi_dict(init_params(config, 0)).items()}
    flat.update({f"PaliGemma/llm/{k}": v for k, v in w.items()})
    for layout, suffix, training in (("params", [], False), ("train/params", ["value"], True)):
        tree: dict = {}
        for key, leaf in flat.items():
            frozen = training and key.removeprefix("PaliGemma/llm/") in w and "lora" not in key
            *parents, last = key.split("/") + suffix
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = np.asarray(jnp.asarray(leaf, jnp.bfloat16 if frozen else jnp.float32))
        ocp.PyTreeCheckpointer().save((root / layout).resolve(), {"params": tree})
    return root


@pytest.fixture(scope="module")
def checkpoints(openpi_ref, tmp_path_factory):
    meta, w, _ = openpi_ref
    return _write_checkpoints(tmp_path_factory.mktemp(f"openpi_{meta['width']}"), meta, w)


@pytest.mark.parametrize("layout", ["released", "training"])
def test_our_restore_of_either_layout_computes_what_openpi_computes_on_it(openpi_ref, checkpoints, layout):
    _, _, ref = openpi_ref
    path = checkpoints / ("params" if layout == "released" else "train/params")
    inputs = {k: jnp.asarray(ref[k]) for k in ("tokens", "mask", "positions", "step_token", "step_position")}
    want = {k.split("/", 1)[1]: v for k, v in ref.items() if k.startswith(layout + "/")}
    config, merged = load_openpi_params(path)  # LoRA merged on load, float32
    assert config.embed_scale_dtype == ("bfloat16" if layout == "training" else None)
    spec = pi05_spec(config)
    _assert_matches(_ours_jit(spec, vlm_decoder(merged), None, inputs), want, ref["mask"], RTOL["merged"])
    _, base = load_openpi_params(path, lora="ignore")  # the decode pool's per-slot adapters
    bank = pi05_lora.stack_adapters([load_openpi_lora(path).vlm], config)
    rows = ll.RowAdapters(bank=bank, ids=jnp.ones((ref["tokens"].shape[0],), jnp.int32))
    _assert_matches(_ours_jit(spec, vlm_decoder(base), rows, inputs), want, ref["mask"], RTOL["slot"])
