"""A π0.5 LoRA fixture at any width, made by openpi's own JAX code, laid out like the shared openpi fixtures.

    PYTHONPATH=<openpi>/src <side venv>/bin/python -m eval.refs.openpi_fixture --width 48 --out /tmp/fx48
    python -m eval.parity /tmp/fx48

Not part of the library, the tests or CI (like `eval.refs.openpi_refs`, whose set-up it shares). It builds openpi's
`Pi0Config(pi05=True)` with LoRA on both experts at the given dims (openpi's `gemma.get_config`,
`PALIGEMMA_VOCAB_SIZE` and SigLIP's `decode_variant` patched at run time, nothing copied), perturbs every leaf
(numpy `PCG64([100, i])`, the shared LoRA fixture's rule: LoRA A += N(0, 1/fan_in), B += N(0, 0.25/rank),
constant leaves re-randomised, others +5 %, the VLM embedder x8, q x3, K x3, MLP output x4), rounds the frozen
leaves to bfloat16 values and writes `params/` (float32), `train_checkpoint/1/params/` (frozen leaves bfloat16,
`value` keys), `merged_params.npz` (float64 merge), `config.json` (alphas, the shared fixture's tolerances) and
`reference.npz`: inputs, `prefix/*` and `actions/num_steps_{1,3,10}` from the released layout, `trainlayout/*`
(prefix tokens, final norm, K/V, actions) from the training layout restored as stored, `merged_*` from openpi's
LoRA-free model with the merged weights, `nolora/*` from the base weights alone.
"""
import argparse
import json
import pathlib
import sys

import numpy as np

from eval.refs.openpi_refs import stand_in_torch


def main():  # noqa: C901, PLR0915  (one straight-line recipe)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--width", type=int, default=48)
    ap.add_argument("--mlp", type=int, default=96)
    ap.add_argument("--act-width", type=int, default=32)
    ap.add_argument("--act-mlp", type=int, default=96)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rank0", type=int, default=4)
    ap.add_argument("--rank1", type=int, default=8)
    ap.add_argument("--horizon", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    stand_in_torch()
    import jax
    import jax.numpy as jnp
    import flax.nnx as nnx
    import orbax.checkpoint as ocp
    from flax import traverse_util
    import openpi.models.gemma as gemma
    import openpi.models.lora as lora
    import openpi.models.siglip as siglip

    gemma.PALIGEMMA_VOCAB_SIZE = a.vocab
    orig_get = gemma.get_config

    def get_config(variant):
        dims = dict(depth=a.depth, num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim)
        if variant.startswith("x_llm"):
            cfg = gemma.Config(width=a.width, mlp_dim=a.mlp, **dims)
            r = a.rank0
        elif variant.startswith("x_expert"):
            cfg = gemma.Config(width=a.act_width, mlp_dim=a.act_mlp, **dims)
            r = a.rank1
        else:
            return orig_get(variant)
        if variant.endswith("_lora"):
            cfg.lora_configs = {"attn": lora.LoRAConfig(rank=r, alpha=float(r)), "ffn": lora.LoRAConfig(rank=r, alpha=float(r))}
        return cfg

    gemma.get_config = get_config
    orig_dv = siglip.decode_variant
    siglip.decode_variant = lambda v: (dict(width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=(14, 14))
                                       if v == "So400m/14" else orig_dv(v))
    from openpi.models import model as _model
    from openpi.models import pi0_config
    from openpi.shared import nnx_utils

    def make_cfg(lora_on):
        sfx = "_lora" if lora_on else ""
        return pi0_config.Pi0Config(pi05=True, paligemma_variant="x_llm" + sfx, action_expert_variant="x_expert" + sfx,
                                    action_dim=32, action_horizon=a.horizon, max_token_len=a.tokens, dtype="float32")

    cfg = make_cfg(True)
    model = cfg.create(jax.random.key(a.seed))
    flat = {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(nnx.state(model).to_pure_dict()).items()}
    frozen_state = nnx.state(model, cfg.get_freeze_filter())
    frozen = {"/".join(str(p) for p in k) for k in traverse_util.flatten_dict(frozen_state.to_pure_dict())}
    # perturb
    out = {}
    for i, k in enumerate(sorted(flat)):
        v = flat[k].astype(np.float64)
        rng = np.random.default_rng([100, i])
        n = rng.standard_normal(v.shape)
        std = float(v.std())
        if k.endswith("lora_a"):
            fan = v.shape[-2] if "attn_vec" not in k else v.shape[-2] * v.shape[-3]
            v = v + n / np.sqrt(fan)
        elif k.endswith("lora_b"):
            v = v + n * np.sqrt(0.25 / v.shape[-2])
        elif std == 0:
            if k.endswith("kernel"):
                v = v + n / np.sqrt(v.shape[-2])
            else:
                v = v + 0.1 * n
            if "Dense_0/bias" in k and "norm" in k:
                third = v.shape[-1] // 3
                v[..., 2 * third:] += 1.0
        else:
            v = v + 0.05 * std * n
        out[k] = v
    L = "PaliGemma/llm/"
    out[L + "embedder/input_embedding"] *= 8
    out[L + "layers/attn/q_einsum/w"] *= 3
    out[L + "layers/attn/kv_einsum/w"][:, 0] *= 3
    out[L + "layers/mlp/linear"] *= 4
    params = {}
    for k, v in out.items():
        v = v.astype(np.float32)
        if k in frozen:
            v = np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32))
        params[k] = v
    assert len(frozen) == 20, len(frozen)
    outdir = pathlib.Path(a.out).resolve()
    outdir.mkdir(parents=True, exist_ok=True)

    def nest(d, value_suffix=False):
        return traverse_util.unflatten_dict({tuple(k.split("/")) + (("value",) if value_suffix else ()): v for k, v in d.items()})

    ck = ocp.PyTreeCheckpointer()
    ck.save(outdir / "params", {"params": nest(params)}, force=True)
    train = {k: (np.asarray(jnp.asarray(v, jnp.bfloat16)) if k in frozen else v) for k, v in params.items()}
    ck.save(outdir / "train_checkpoint/1/params", {"params": nest(train, True)}, force=True)

    # inputs
    B, T, H = 2, a.tokens, a.horizon
    rng = np.random.default_rng(1000)
    cams = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    ref = {}
    for c in cams:
        ref[f"image/{c}"] = rng.uniform(-1, 1, (B, 224, 224, 3)).astype(np.float32)
        ref[f"image_mask/{c}"] = np.array([True, c != "left_wrist_0_rgb"])
    ref["state"] = rng.uniform(-1, 1, (B, 32)).astype(np.float32)
    toks = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), bool)
    for b, n in enumerate((13, 30)):
        toks[b, 0] = 2
        toks[b, 1:n] = rng.integers(3, a.vocab, n - 1)
        mask[b, :n] = True
    ref["tokenized_prompt"], ref["tokenized_prompt_mask"] = toks, mask
    ref["noise"] = rng.standard_normal((B, H, 32)).astype(np.float32)
    obs = _model.Observation.from_dict({
        "image": {c: jnp.asarray(ref[f"image/{c}"]) for c in cams},
        "image_mask": {c: jnp.asarray(ref[f"image_mask/{c}"]) for c in cams},
        "state": jnp.asarray(ref["state"]), "tokenized_prompt": jnp.asarray(toks), "tokenized_prompt_mask": jnp.asarray(mask)})

    from openpi.models import pi0 as pi0mod

    def prefix_pass(m, o):
        tokens, input_mask, ar = m.embed_prefix(o)
        attn = pi0mod.make_attn_mask(input_mask, ar)
        pos = jnp.cumsum(input_mask, axis=1) - 1
        (outs, _), (k, v) = m.PaliGemma.llm([tokens, None], mask=attn, positions=pos)
        return dict(tokens=tokens, input_mask=input_mask, ar=ar, positions=pos, normed=outs, k=k, v=v)

    def outputs(m, steps=(1, 3, 10)):
        gd, st = nnx.split(m)
        r = jax.jit(lambda s: prefix_pass(nnx.merge(gd, s), obs))(st)
        acts = {}
        for n in steps:
            f = nnx_utils.module_jit(m.sample_actions, static_argnames=("num_steps",))
            acts[n] = np.asarray(f(jax.random.key(0), obs, num_steps=n, noise=jnp.asarray(ref["noise"])))
        return {k: np.asarray(v) for k, v in r.items()}, acts

    restored_f32 = _model.restore_params(outdir / "params", restore_type=np.ndarray)
    m32 = cfg.load(restored_f32)
    p, acts = outputs(m32)
    ref.update({"prefix/tokens": p["tokens"], "prefix/input_mask": p["input_mask"], "prefix/ar_mask": p["ar"],
                "prefix/positions": p["positions"].astype(np.int32), "prefix/out_final_norm": p["normed"],
                "prefix/kv_cache_k": p["k"], "prefix/kv_cache_v": p["v"]})
    for n, x in acts.items():
        ref[f"actions/num_steps_{n}"] = x
    restored_tr = _model.restore_params(outdir / "train_checkpoint/1/params", restore_type=np.ndarray)
    mtr = cfg.load(restored_tr)
    p, acts = outputs(mtr, steps=(10,))
    ref.update({"trainlayout/prefix/tokens": p["tokens"], "trainlayout/prefix/out_final_norm": p["normed"],
                "trainlayout/prefix/kv_cache_k": p["k"], "trainlayout/prefix/kv_cache_v": p["v"],
                "trainlayout/actions/num_steps_10": acts[10]})
    # merged (float64 merge as the fixture does)
    merged = {}
    def fold(k_w, k_a, k_b, eq, s):
        merged[k_w] = (params[k_w].astype(np.float64) + s * np.einsum(eq, params[k_a].astype(np.float64), params[k_b].astype(np.float64))).astype(np.float32)
    for sfx in ("", "_1"):
        at = f"{L}layers/attn/"
        fold(f"{at}q_einsum{sfx}/w", f"{at}q_einsum{sfx}/lora_a", f"{at}q_einsum{sfx}/lora_b", "lndr,lnrh->lndh", 1.0)
        fold(f"{at}kv_einsum{sfx}/w", f"{at}kv_einsum{sfx}/lora_a", f"{at}kv_einsum{sfx}/lora_b", "lckdr,lckrh->lckdh", 1.0)
        bsum = params[f"{at}attn_vec_einsum{sfx}/lora_b"].astype(np.float64).sum(1)
        w = params[f"{at}attn_vec_einsum{sfx}/w"]
        merged[f"{at}attn_vec_einsum{sfx}/w"] = (w.astype(np.float64) + np.einsum("lnhr,lrd->lnhd", params[f"{at}attn_vec_einsum{sfx}/lora_a"].astype(np.float64), bsum)).astype(np.float32)
        ml = f"{L}layers/mlp{sfx}/"
        fold(f"{ml}gating_einsum", f"{ml}gating_einsum_lora_a", f"{ml}gating_einsum_lora_b", "lcdr,lcrf->lcdf", 1.0)
        fold(f"{ml}linear", f"{ml}linear_lora_a", f"{ml}linear_lora_b", "lfr,lrd->lfd", 1.0)
    np.savez(outdir / "merged_params.npz", **merged)
    cfg0 = make_cfg(False)
    base = {k: v for k, v in params.items() if "lora" not in k}
    mm = cfg0.load(traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in {**base, **merged}.items()}))
    p, acts = outputs(mm, steps=(10,))
    ref.update({"merged_prefix/kv_cache_k": p["k"], "merged_prefix/kv_cache_v": p["v"],
                "merged_actions/num_steps_10": acts[10]})
    mn = cfg0.load(traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in base.items()}))
    _, acts = outputs(mn, steps=(10,))
    ref["nolora/actions/num_steps_10"] = acts[10]
    np.savez(outdir / "reference.npz", **ref)
    pub = json.loads(pathlib.Path("/work/shared/fixtures/openpi_tiny_pi05_lora/config.json").read_text())
    (outdir / "config.json").write_text(json.dumps({
        "lora": {"paligemma_llm (expert 0)": {"rank": a.rank0, "alpha": float(a.rank0)},
                 "action_expert (expert 1)": {"rank": a.rank1, "alpha": float(a.rank1)}},
        "suggested_tolerances_float32_cpu": pub["suggested_tolerances_float32_cpu"]}, indent=1))
    def d(x, y, valid=None):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.max(np.abs(x - y)))
    vm = ref["prefix/input_mask"]
    print("openpi trainlayout vs f32: tokens", d(ref["trainlayout/prefix/tokens"], ref["prefix/tokens"]),
          "normed", d(ref["trainlayout/prefix/out_final_norm"][vm], ref["prefix/out_final_norm"][vm]),
          "k", d(np.moveaxis(ref["trainlayout/prefix/kv_cache_k"], 0, 2)[vm], np.moveaxis(ref["prefix/kv_cache_k"], 0, 2)[vm]),
          "v", d(np.moveaxis(ref["trainlayout/prefix/kv_cache_v"], 0, 2)[vm], np.moveaxis(ref["prefix/kv_cache_v"], 0, 2)[vm]),
          "actions", d(ref["trainlayout/actions/num_steps_10"], ref["actions/num_steps_10"]))
    print("openpi merged vs lora: k", d(np.moveaxis(ref["merged_prefix/kv_cache_k"], 0, 2)[vm], np.moveaxis(ref["prefix/kv_cache_k"], 0, 2)[vm]),
          "v", d(np.moveaxis(ref["merged_prefix/kv_cache_v"], 0, 2)[vm], np.moveaxis(ref["prefix/kv_cache_v"], 0, 2)[vm]),
          "maxK", float(np.abs(ref["prefix/kv_cache_k"]).max()), "max tok", float(np.abs(ref["prefix/tokens"][:, -a.tokens:]).max()))


if __name__ == "__main__":
    main()
