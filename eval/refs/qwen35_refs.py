"""Reference outputs of Hugging Face transformers' own Qwen3.5 text model on random weights, at any dims.

Run in a side environment that has torch and transformers (not this project's venv; CI never imports this):

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
    OMP_NUM_THREADS=1 /tmp/hfvenv/bin/python eval/refs/qwen35_refs.py --shape untied_g3 --out /tmp/q35   # -> /tmp/q35/untied_g3
    OMP_NUM_THREADS=1 /tmp/hfvenv/bin/python eval/refs/qwen35_refs.py --all --compact --primitives --out tests/data/qwen35_refs

Each output directory is an HF text-only Qwen3.5 checkpoint (`Qwen3_5ForCausalLM`: config.json with
model_type 'qwen3_5_text', model.safetensors in HF's layout, `lm_head.weight` only when untied) plus
`reference.npz` with the text arrays of the qwen35_tiny fixture's layout (`python -m eval.parity DIR` compares
all of them): logits, hidden_states, full layers' K/V, the linear layers' taps (gdn_qkv / z / a / b / core),
conv / recurrent states after prefill (batch and each row alone), and a 10-token greedy `generate` (tokens,
step logits, final states). `--compact` (the COMPACT shapes, CI's copies) keeps rows 0 and 1 only, drops
the per-layer projections and solo states and generates 6 tokens (`tests/test_qwen35_refs.py` compares
them); `--primitives` writes torch's results for `nn.torch_order`'s bit-level tests.

Model and inputs, as the fixture's generator does: float32 on CPU, eager attention, `torch.manual_seed(seed)`
before the model is built, `initializer_range` 0.2, every norm weight += 0.1 randn (named_modules order, same
generator), A_log = log U(0.02, 0.3) and dt_bias ~ N(0, 0.5^2) from `torch.Generator().manual_seed(seed + 99)`.
Text batch B = 3 of T tokens, ids in [4, vocab) from `torch.Generator().manual_seed(seed + 1234)`: row 0
unpadded, row 1 left-padded by T // 6, row 2 right-padded by T // 9; positions cumsum(mask) - 1 (pads 0).
flash-linear-attention / causal-conv1d must not be installed: the torch fallbacks are the reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

def _shape(d, f, heads, head_dim, rotary, sections, gdn, kernel, vocab, group, groups, tie, t, seed, init=0.2):
    """(text config fields, T, seed) of one shape. heads = (N, K); gdn = (Hk, Hv, Dk, Dv); group: 'l' linear,
    'f' full, one letter per layer of the group that repeats `groups` times."""
    hk, hv, dk, dv = gdn
    return (dict(hidden_size=d, intermediate_size=f, num_attention_heads=heads[0], num_key_value_heads=heads[1],
                 head_dim=head_dim, partial_rotary_factor=rotary, mrope_section=list(sections), linear_num_key_heads=hk,
                 linear_num_value_heads=hv, linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=kernel,
                 vocab_size=vocab, initializer_range=init,
                 layer_types=["linear_attention" if c == "l" else "full_attention" for c in group], groups=groups,
                 tie_word_embeddings=tie), t, seed)


# Dims chosen to differ from the public qwen35_tiny fixture in every axis the hybrid stack has: width, head
# counts and KV ratio, head dim, rotary fraction and M-RoPE sections, GDN key / value heads and dims (Dk != Dv
# both ways), conv kernel, group pattern and count, tied or untied.
SHAPES: dict[str, tuple[dict, int, int]] = {
    # the public fixture's text dims (a sanity row: our errors here track the fixture's)
    "fixture_dims": _shape(64, 128, (4, 2), 32, 0.25, (2, 1, 1), (2, 4, 16, 8), 4, 512, "lllf", 2, True, 80, 0),
    # untied head, 3 groups of (linear, linear, full), KV ratio 3, rotary 1/2, Dk > Dv, kernel 3
    "untied_g3": _shape(96, 160, (6, 2), 24, 0.5, (2, 2, 2), (3, 6, 24, 16), 3, 384, "llf", 3, False, 80, 1),
    # wide: 5 groups of (linear x3, full), one KV head, Hv = 4 Hk, Dk < Dv, kernel 4, untied
    "wide_g5": _shape(128, 256, (8, 1), 32, 0.25, (2, 1, 1), (2, 8, 16, 32), 4, 640, "lllf", 5, False, 96, 2),
    # (linear, full) x 7 = odd count 7, full rotary, no GQA, Hv = Hk, kernel 5, tied
    "full_rope_g7": _shape(48, 144, (3, 3), 16, 1.0, (4, 2, 2), (3, 3, 8, 12), 5, 256, "lf", 7, True, 72, 3),
    # the released head dims (256, rotary 64, sections (11, 11, 10); Dk = Dv = 128) at a small width, untied
    "release_heads": _shape(128, 192, (2, 1), 256, 0.25, (11, 11, 10), (1, 2, 128, 128), 4, 320, "lllf", 3, False, 80, 4),
}
# CI's copies (tests/data/qwen35_refs): width 32, a small vocabulary and T just over one chunk keep each
# directory near 0.5 MB; they still differ from the fixture in every axis above. initializer_range 0.3 (not
# 0.2) makes such a narrow model amplify rounding about as much as a 64-wide one does.
COMPACT = {
    "ci_untied_g2": _shape(32, 48, (2, 1), 16, 0.5, (2, 1, 1), (1, 2, 16, 8), 3, 80, "llf", 2, False, 66, 11, init=0.3),
    "ci_tied_g3": _shape(32, 48, (4, 2), 8, 1.0, (2, 1, 1), (2, 2, 8, 12), 5, 96, "lf", 3, True, 66, 12, init=0.3),
}
GEN_STEPS, COMPACT_GEN_STEPS = 10, 6


def text_config(fields: dict, dtype: str = "float32"):
    from transformers import Qwen3_5TextConfig

    f = dict(fields)
    groups = f.pop("groups")
    types = f.pop("layer_types") * groups
    rope = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=f.pop("partial_rotary_factor"),
                mrope_section=f.pop("mrope_section"), mrope_interleaved=True)
    return Qwen3_5TextConfig(num_hidden_layers=len(types), layer_types=types, rope_parameters=rope, rms_norm_eps=1e-6,
                             max_position_embeddings=4096, pad_token_id=0, bos_token_id=None,
                             eos_token_id=None, hidden_act="silu", attention_bias=False, dtype=dtype, **f)


def build_model(fields: dict, seed: int):
    """`Qwen3_5ForCausalLM` in float32 with the perturbed random weights described in the module docstring."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    config = text_config(fields)
    config._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(config).eval().to(torch.float32)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith("norm") or name.endswith("layernorm"):
                mod.weight += 0.1 * torch.randn_like(mod.weight)
        gen = torch.Generator().manual_seed(seed + 99)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                la = layer.linear_attn
                la.A_log.copy_(torch.log(torch.empty(la.A_log.shape).uniform_(0.02, 0.3, generator=gen)))
                la.dt_bias.copy_(0.5 * torch.randn(la.dt_bias.shape, generator=gen))
    return model


def _check_torch_path():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    for name in ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        fn = getattr(m, name)
        assert getattr(fn, "__module__", m.__name__) == m.__name__, f"{name} is not transformers' torch fallback"
    for pkg in ("fla", "causal_conv1d"):
        try:
            __import__(pkg)
        except ImportError:
            continue
        raise SystemExit(f"{pkg} is installed: uninstall it so transformers runs its torch reference path")


def _batch(vocab: int, t: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed + 1234)
    ids = torch.randint(4, vocab, (3, t), generator=gen)
    mask = torch.ones(3, t, dtype=torch.long)
    mask[1, : t // 6] = 0
    mask[2, t - t // 9:] = 0
    ids = ids * mask  # pads are id 0
    positions = torch.where(mask.bool(), mask.cumsum(-1) - 1, 0)
    return ids, mask, positions


def _states(cache, linear, full):
    conv = np.stack([cache.layers[i].conv_states[0].numpy() for i in linear])
    rec = np.stack([cache.layers[i].recurrent_states[0].numpy() for i in linear])
    k = np.stack([cache.layers[i].keys.numpy() for i in full])
    v = np.stack([cache.layers[i].values.numpy() for i in full])
    return conv, rec, k, v


def references(model, t: int, seed: int, gen_steps: int = GEN_STEPS) -> dict[str, np.ndarray]:
    """The fixture's text arrays (reference.npz keys) from transformers' forward and generate."""
    import torch

    cfg = model.config
    types = list(cfg.layer_types)
    linear = [i for i, x in enumerate(types) if x == "linear_attention"]
    full = [i for i, x in enumerate(types) if x == "full_attention"]
    ids, mask, positions = _batch(cfg.vocab_size, t, seed)
    taps: dict[str, list] = {k: [] for k in ("qkv", "z", "a", "b", "core")}
    hooks = []
    for i in linear:
        la = model.model.layers[i].linear_attn
        for name, mod in (("qkv", la.in_proj_qkv), ("z", la.in_proj_z), ("a", la.in_proj_a), ("b", la.in_proj_b)):
            hooks.append(mod.register_forward_hook(lambda m, a, out, n=name: taps[n].append(out.detach().clone())))
        hooks.append(la.norm.register_forward_pre_hook(lambda m, a: taps["core"].append(a[0].detach().clone())))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, output_hidden_states=True)
    for h in hooks:
        h.remove()
    b = ids.shape[0]
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    conv, rec, k, v = _states(out.cache, linear, full)
    ref = dict(
        linear_layer_indices=np.asarray(linear, np.int32), full_layer_indices=np.asarray(full, np.int32),
        input_ids=ids.numpy().astype(np.int32), attention_mask=mask.numpy().astype(np.int32),
        position_ids=np.broadcast_to(positions.numpy(), (3,) + positions.shape).astype(np.int32),
        logits=out.logits.numpy(), hidden_states=np.stack([h.numpy() for h in out.hidden_states]),
        k_cache=k, v_cache=v, conv_states=conv, recurrent_states=rec,
        gdn_qkv=np.stack([x.numpy() for x in taps["qkv"]]),
        gdn_z=np.stack([x.numpy().reshape(b, t, hv, dv) for x in taps["z"]]),
        gdn_a=np.stack([x.numpy() for x in taps["a"]]), gdn_b=np.stack([x.numpy() for x in taps["b"]]),
        gdn_core=np.stack([x.numpy().reshape(b, t, hv, dv) for x in taps["core"]]))
    solo_conv, solo_rec = [], []
    for r in range(b):
        keep = mask[r].bool()
        with torch.no_grad():
            o = model(input_ids=ids[r:r + 1, keep], use_cache=True,
                      position_ids=torch.arange(int(keep.sum()))[None])
        c, s, _, _ = _states(o.cache, linear, full)
        solo_conv.append(c[:, 0]), solo_rec.append(s[:, 0])
    ref["solo_conv_states"], ref["solo_recurrent_states"] = np.stack(solo_conv, 1), np.stack(solo_rec, 1)
    rows = [0, 1]  # generation continues the unpadded and the left-padded rows
    with torch.no_grad():
        g = model.generate(input_ids=ids[rows], attention_mask=mask[rows], max_new_tokens=gen_steps, min_new_tokens=gen_steps,
                           do_sample=False, num_beams=1, use_cache=True, pad_token_id=0, eos_token_id=None,
                           output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(list(g.logits), 1).numpy()
    top2 = np.sort(logits, -1)[..., -2:]
    conv_g, rec_g, _, _ = _states(g.cache, linear, full)
    ref.update(gen_rows=np.asarray(rows, np.int32), gen_tokens=g.sequences[:, t:].numpy().astype(np.int32), gen_logits=logits,
               gen_top2_margin=(top2[..., 1] - top2[..., 0]).astype(np.float32), gen_final_conv_states=conv_g,
               gen_final_recurrent_states=rec_g)
    return ref


def compact(ref: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """CI's subset, still the fixture's layout (`python -m eval.parity` reads it): rows 0 and 1 (unpadded,
    left-padded; generation uses those two), without the per-layer projections gdn_qkv / z / a / b and the
    solo states (rows 0 and 1 alone have their batch states)."""
    batch_axis = {"input_ids": 0, "attention_mask": 0, "logits": 0, "position_ids": 1, "hidden_states": 1, "k_cache": 1,
                  "v_cache": 1, "conv_states": 1, "recurrent_states": 1, "gdn_core": 1}
    drop = {"gdn_qkv", "gdn_z", "gdn_a", "gdn_b", "solo_conv_states", "solo_recurrent_states"}
    return {k: (np.take(v, [0, 1], axis=batch_axis[k]) if k in batch_axis else v) for k, v in ref.items() if k not in drop}


PRIMITIVE_SEED = 5


def primitives() -> dict[str, np.ndarray]:
    """torch's float32 CPU results of the operations `nn.torch_order` reproduces, on seeded random inputs:
    last-axis sums and means (lengths from 3 to 1000, torch's cascade included), 1 / sqrt, cumsum of decay-like
    values, `F.linear` and batched `matmul` at the parity models' sizes, and transformers' own l2norm and
    (1 + w) RMSNorm. `tests/test_torch_order.py` asserts equality bit for bit."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    torch.set_num_threads(1)
    rng = np.random.default_rng(PRIMITIVE_SEED)
    out: dict[str, np.ndarray] = {}
    for n in (3, 5, 8, 13, 64, 100, 520, 1000):
        x = (rng.standard_normal((4, n)) * 2).astype(np.float32)
        out[f"sum_x{n}"], out[f"sum_{n}"] = x, torch.from_numpy(x).sum(-1).numpy()
        out[f"mean_{n}"] = torch.from_numpy(x).pow(2).mean(-1).numpy()
    v = np.abs(rng.standard_normal(256)).astype(np.float32) + 1e-3
    out["rsqrt_x"], out["rsqrt"] = v, torch.rsqrt(torch.from_numpy(v)).numpy()
    g = -rng.uniform(0.0, 1.5, (6, 64)).astype(np.float32)
    out["cumsum_x"], out["cumsum"] = g, torch.from_numpy(g).cumsum(-1).numpy()
    for k, n in ((32, 4), (64, 24), (64, 96), (96, 72)):
        x = rng.standard_normal((16, k)).astype(np.float32)
        w = (rng.standard_normal((n, k)) * 0.2).astype(np.float32)  # torch layout [out, in]
        out[f"linear_x{k}_{n}"], out[f"linear_w{k}_{n}"] = x, w
        out[f"linear_{k}_{n}"] = F.linear(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    a = rng.standard_normal((1, 2, 64, 16)).astype(np.float32)
    b = rng.standard_normal((1, 2, 16, 8)).astype(np.float32)
    out["matmul_a"], out["matmul_b"], out["matmul"] = a, b, (torch.from_numpy(a) @ torch.from_numpy(b)).numpy()
    x = rng.standard_normal((20, 24)).astype(np.float32)
    out["l2norm_x"], out["l2norm"] = x, m.l2norm(torch.from_numpy(x)).numpy()
    norm = m.Qwen3_5RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy((rng.standard_normal(48) * 0.1).astype(np.float32)))
        x = (rng.standard_normal((20, 48)) * 3).astype(np.float32)
        out["rmsnorm_w"], out["rmsnorm_x"], out["rmsnorm"] = norm.weight.numpy().copy(), x, norm(torch.from_numpy(x)).numpy()
    return out


def save_checkpoint(model, out: Path) -> None:
    """config.json and model.safetensors in HF's layout (the tied head is not stored, as save_pretrained does)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["architectures"] = ["Qwen3_5ForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def make(fields: dict, t: int, seed: int, out: Path, compact_refs: bool = False) -> dict:
    import torch
    import transformers

    _check_torch_path()
    torch.set_num_threads(1)
    model = build_model(fields, seed)
    ref = references(model, t, seed, COMPACT_GEN_STEPS if compact_refs else GEN_STEPS)
    save_checkpoint(model, out)
    ref = compact(ref) if compact_refs else ref
    np.savez_compressed(out / "reference.npz", **ref)
    meta = dict(fields=fields, tokens=t, seed=seed, compact=compact_refs, torch=torch.__version__,
                transformers=transformers.__version__, numpy=np.__version__,
                min_gen_top2_margin=float(ref["gen_top2_margin"].min()))
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(COMPACT), action="append", help="one shape (repeatable)")
    ap.add_argument("--all", action="store_true", help="every shape of SHAPES (with --compact: of COMPACT, CI's)")
    ap.add_argument("--compact", action="store_true", help="--all means the COMPACT shapes (CI's copies)")
    ap.add_argument("--seed", type=int, action="append", help="other seeds than the shape's (repeatable): writes SHAPE_sSEED")
    ap.add_argument("--primitives", action="store_true", help="also write torch_primitives.npz (nn.torch_order's bit tests)")
    ap.add_argument("--out", type=Path, required=True, help="parent directory; one subdirectory per shape")
    args = ap.parse_args(argv)
    if args.primitives:
        args.out.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(args.out / "torch_primitives.npz", **primitives())
        print(f"primitives: {args.out / 'torch_primitives.npz'}")
    table = COMPACT if args.compact else SHAPES
    names = sorted(table) if args.all else (args.shape or [])
    if not names and not args.primitives:
        ap.error("name --shape, --all or --primitives")
    for name in names:
        fields, t, seed = table[name] if name in table else (SHAPES | COMPACT)[name]
        for seed, out in ([(s, args.out / f"{name}_s{s}") for s in args.seed] if args.seed else [(seed, args.out / name)]):
            meta = make(fields, t, seed, out, compact_refs=name in COMPACT)
            print(f"{name} seed {seed}: {out} (min top-2 margin {meta['min_gen_top2_margin']:.3g})")


if __name__ == "__main__":
    main()
