"""Reference arrays of π0.5's VLM expert made by openpi's own JAX code, in both checkpoint layouts, at any width.

    PYTHONPATH=<openpi>/src <side venv>/bin/python -m eval.refs.openpi_refs --widths 48 72 --out tests/data/openpi_refs

Not part of the library, the tests or CI (which only read the `.npz` files it writes): it imports openpi's
`src/openpi/models/gemma.py` and runs it, so it needs openpi's source tree and its JAX stack (jax 0.5.3,
flax 0.10.2, jaxtyping, beartype, einops, as pinned by openpi's shared fixtures; torch is replaced by an
empty stand-in module, `stand_in_torch`; the JAX path never calls it). Nothing of openpi is copied here.

For each width D it draws one VLM expert with LoRA on attention and feed-forward (numpy `PCG64([seed, i])`
per leaf, leaves in sorted path order), rounds the frozen leaves (every non-LoRA leaf, openpi's freeze
filter for a LoRA fine-tune) to bfloat16 values, and runs openpi's `gemma.Module` under `jax.jit`:

* `released/*`: every leaf float32 (openpi's released layout, which holds the same values);
* `training/*`: the frozen leaves as bfloat16 arrays, the LoRA leaves float32, activations float32 (openpi's
  training layout restored as stored, `Pi0Config(dtype="float32")`): the embedder then scales by
  `sqrt(D)` rounded to bfloat16 and RMSNorm sees a bfloat16 scale.

Each layout stores, for a batch of prompts at positions starting at `--offset` (a prefix after camera tokens):
`embed` (prompt-token embeddings [B, T, D]), `k`, `v` (every layer's cache, [L, B, T, K, H], K after RoPE),
`normed` (after the final norm, [B, T, D]), `logits` ([B, T, V] from the tied embedder), and one decode step
on that cache: `step_k`, `step_v` ([L, B, 1, K, H]), `step_normed` ([B, 1, D]). Weights are stored under
`w/<openpi path below PaliGemma/llm/>` (float32; the frozen ones hold bfloat16 values), with `tokens`,
`positions`, `mask`, `step_token`, `step_position` and the dims in `meta` (a JSON string).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np

_FROZEN_HINT = "lora"  # leaves whose path has no "lora" are frozen in openpi's LoRA fine-tunes


def stand_in_torch() -> None:
    """openpi's model modules import torch (and its PyTorch port) at the top; the JAX path never calls them."""
    torch = types.ModuleType("torch")
    torch.Tensor = type("Tensor", (), {})
    torch.uint8 = torch.float32 = object()
    nn = types.ModuleType("torch.nn")
    nn.functional = types.ModuleType("torch.nn.functional")
    torch.nn = nn
    port = types.ModuleType("openpi.models_pytorch")
    port.pi0_pytorch = types.ModuleType("openpi.models_pytorch.pi0_pytorch")
    sys.modules.update({"torch": torch, "torch.nn": nn, "torch.nn.functional": nn.functional,
                        "openpi.models_pytorch": port, "openpi.models_pytorch.pi0_pytorch": port.pi0_pytorch})


def _dims(width: int) -> dict:
    """Tiny dims around `width`: MLP 2D, 2 heads of 8, one KV head, LoRA rank 4, 2 layers, vocabulary 64, 2 prompts
    of 12 tokens at positions from 800 (after ~800 image tokens, where RoPE angles are large)."""
    return dict(width=width, depth=2, mlp_dim=2 * width, num_heads=2, num_kv_heads=1, head_dim=8, vocab=64, rank=4,
                batch=2, tokens=12, offset=800)


def _draw(path: str, shape: tuple[int, ...], rng: np.random.Generator, dims: dict) -> np.ndarray:
    """One leaf: fan-in scaled normals, norm scales N(0, 0.3) (so 1 + scale is not a bfloat16 number),
    LoRA A ~ N(0, 1/fan_in), B ~ N(0, 0.25/rank) (an update about half the size of W)."""
    n = rng.standard_normal(shape)
    if path.endswith("scale"):
        return 0.3 * n
    if path == "embedder/input_embedding":
        return 0.15 * n
    if "lora_b" in path:
        return n * np.sqrt(0.25 / dims["rank"])
    fan_in = {"attn_vec": dims["num_heads"] * dims["head_dim"], "linear": dims["mlp_dim"]}
    fan = next((v for k, v in fan_in.items() if k in path), dims["width"])
    w = n / np.sqrt(fan)
    if path == "layers/attn/q_einsum/w":
        w *= 3.0  # sharper attention, as the shared fixtures do
    if path == "layers/attn/kv_einsum/w":
        w[:, 0] *= 3.0
    return w


def make(width: int, seed: int = 0) -> dict[str, np.ndarray]:
    """openpi's outputs at `width` in both layouts (module docstring), with the weights and inputs."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    import openpi.models.gemma as gemma
    import openpi.models.lora as lora

    d = _dims(width)
    gemma.PALIGEMMA_VOCAB_SIZE = d["vocab"]
    config = gemma.Config(width=width, depth=d["depth"], mlp_dim=d["mlp_dim"], num_heads=d["num_heads"],
                          num_kv_heads=d["num_kv_heads"], head_dim=d["head_dim"],
                          lora_configs={t: lora.LoRAConfig(rank=d["rank"], alpha=float(d["rank"])) for t in ("attn", "ffn")})
    module = gemma.Module(configs=[config], embed_dtype="float32")
    # gemma.Module defines its own `init` (openpi's convenience method), so linen's is called by name.
    shapes = jax.eval_shape(lambda: nn.Module.init(module, jax.random.key(0), [False], method="init"))["params"]
    flat = {"/".join(k): v.shape for k, v in traverse_util.flatten_dict(shapes).items()}
    weights = {}
    for i, path in enumerate(sorted(flat)):
        w = _draw(path, flat[path], np.random.default_rng([seed, i]), d).astype(np.float32)
        if _FROZEN_HINT not in path:  # both layouts hold the same (bfloat16) values
            w = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32))
        weights[path] = w

    rng = np.random.default_rng([seed, 10_000])
    b, t = d["batch"], d["tokens"]
    tokens = rng.integers(3, d["vocab"], (b, t)).astype(np.int32)
    mask = np.ones((b, t), bool)
    mask[1, t - 4:] = False  # row 1: a shorter prompt (padding at the end)
    positions = (d["offset"] + np.cumsum(mask, axis=1) - 1).astype(np.int32)
    attn = mask[:, None, :] & mask[:, :, None]  # bidirectional prompt (π0.5's prefix)
    step_token = rng.integers(3, d["vocab"], (b, 1)).astype(np.int32)
    step_position = (d["offset"] + mask.sum(1, keepdims=True)).astype(np.int32)
    step_attn = np.concatenate([mask, np.ones((b, 1), bool)], axis=1)[:, None, :]

    def run(params):
        embed = module.apply({"params": params}, jnp.asarray(tokens), method="embed")
        (normed,), (k, v) = module.apply({"params": params}, [embed], jnp.asarray(positions), jnp.asarray(attn))
        logits = module.apply({"params": params}, normed, method=lambda m, x: m.embedder.decode(x))
        step = module.apply({"params": params}, jnp.asarray(step_token), method="embed")
        (step_normed,), (sk, sv) = module.apply({"params": params}, [step], jnp.asarray(step_position),
                                                jnp.asarray(step_attn), kv_cache=(k, v))
        return dict(embed=embed, k=k, v=v, normed=normed, logits=logits, step_k=sk[:, :, -1:], step_v=sv[:, :, -1:],
                    step_normed=step_normed)

    def tree(cast_frozen):
        leaves = {tuple(p.split("/")): (jnp.asarray(w, jnp.bfloat16) if cast_frozen and _FROZEN_HINT not in p
                                        else jnp.asarray(w)) for p, w in weights.items()}
        return traverse_util.unflatten_dict(leaves)

    out = {f"w/{p}": w for p, w in weights.items()}
    out.update(tokens=tokens, mask=mask, positions=positions, step_token=step_token, step_position=step_position)
    for layout, cast in (("released", False), ("training", True)):
        for name, value in jax.jit(run)(tree(cast)).items():
            assert value.dtype == jnp.float32, (layout, name, value.dtype)
            out[f"{layout}/{name}"] = np.asarray(value)
    versions = {m: sys.modules[m].__version__ for m in ("jax", "flax", "numpy")}
    out["meta"] = np.asarray(json.dumps(dict(d, seed=seed, versions=versions, platform=jax.default_backend())))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[48, 72])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("tests/data/openpi_refs"))
    args = ap.parse_args(argv)
    stand_in_torch()
    args.out.mkdir(parents=True, exist_ok=True)
    for width in args.widths:
        arrays = make(width, args.seed)
        path = args.out / f"width{width}.npz"
        np.savez_compressed(path, **arrays)
        tr, rel = arrays["training/embed"], arrays["released/embed"]
        print(f"{path}: {path.stat().st_size} bytes; openpi training vs released layout: "
              f"embed {np.abs(tr - rel).max():.3g}, normed {np.abs(arrays['training/normed'] - arrays['released/normed']).max():.3g}, "
              f"k {np.abs(arrays['training/k'] - arrays['released/k']).max():.3g}")


if __name__ == "__main__":
    main()
