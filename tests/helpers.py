"""Small builders shared by the tests (tiny inputs only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxygen_jax.models.pi05.config import ModelConfig
from oxygen_jax.models.pi05.observation import Observation

REPO = Path(__file__).resolve().parents[1]

# The suite's fast-compile XLA flags (tests/conftest.py). Under both together, and only then, XLA's CPU
# backend rounds Qwen3.5's layer scan differently in programs that differ elsewhere (other outputs kept,
# a LoRA term on other rows): ~1e-5 apart, measured. Under XLA's defaults (OXYGEN_JAX_TEST_XLA_DEFAULTS=1)
# and each flag alone such programs are bit-identical, and the tests that see it assert so there.
FAST_CODEGEN = all(f in os.environ.get("XLA_FLAGS", "") for f in ("--xla_backend_optimization_level=0",
                                                                  "--xla_cpu_use_fusion_emitters=false"))


def shared_dir() -> Path:
    env = os.environ.get("OXYGEN_SHARED_DIR")
    return (Path(env) if env else REPO.parent / "shared").resolve()


def fixture(*parts: str) -> Path:
    """A path inside ../shared/fixtures, or a visible skip naming it when it is absent."""
    path = shared_dir().joinpath("fixtures", *parts)
    if not path.exists():
        pytest.skip(f"../shared fixtures not present: {path} (clone beside ../shared, or set OXYGEN_SHARED_DIR)")
    return path


def openpi_fixture() -> Path:
    """The openpi tiny π0.5 fixture directory, or a visible skip when ../shared is absent."""
    return fixture("openpi_tiny_pi05")


def leaves_equal(a, b) -> bool:
    """The two pytrees have the same leaves, bit for bit: dtype, shape and values."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    same = lambda x, y: x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))  # noqa: E731
    return len(la) == len(lb) and all(same(x, y) for x, y in zip(la, lb))


def write_norm_stats(root: Path, asset_id: str, dim: int) -> None:
    """openpi's `assets/<asset_id>/norm_stats.json` under a checkpoint root: zero mean, unit std, q01/q99 = -1/1."""
    entry = {"mean": [0.0] * dim, "std": [1.0] * dim, "q01": [-1.0] * dim, "q99": [1.0] * dim}
    path = root / "assets" / asset_id / "norm_stats.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"norm_stats": {"state": entry, "actions": entry}}))


def make_obs(
    cfg: ModelConfig, *, batch: int = 2, cameras: int = 2, prompt_len: int = 12, lengths=None, image_masks=None,
    seed: int = 0,
) -> Observation:
    """A random observation: BOS + random ids, 0-padded; all cameras valid unless `image_masks`."""
    rng = np.random.default_rng(seed)
    s = cfg.siglip.image_size
    lengths = lengths if lengths is not None else [prompt_len - 2 - (i % 3) for i in range(batch)]
    tokens = np.zeros((batch, prompt_len), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(3, cfg.vocab_size, n)
        tokens[b, 0] = 2
    masks = np.ones((batch, cameras), bool) if image_masks is None else np.asarray(image_masks, bool)
    return Observation(
        images=jnp.asarray(rng.uniform(-1, 1, (batch, cameras, s, s, 3)), jnp.float32),
        image_masks=jnp.asarray(masks),
        tokens=jnp.asarray(tokens),
        token_mask=jnp.asarray(tokens > 0),
    )


def diverse_text_params(params):
    """Scales the VLM expert so that greedy decoding with random weights does not just repeat its
    input token (with a tied LM head, a random network's residual stream is dominated by the input
    embedding). Makes token-equality tests meaningful; not a model anyone should use."""
    import dataclasses

    layers = params.vlm.layers
    layers = dataclasses.replace(
        layers, q=layers.q * 3, kv=layers.kv.at[:, 0].multiply(3), linear=layers.linear * 20, out=layers.out * 10
    )
    return dataclasses.replace(params, vlm=dataclasses.replace(params.vlm, layers=layers))


def recompute_greedy(params, obs, num_tokens: int, row: int = 0, prompt=()):
    """Reference text decoding without any cache: every token re-runs the whole sequence
    [prefix | request prompt | generated] through the VLM expert. Returns (tokens, logits [n, V]).

    The sequence is held in one fixed-length buffer whose unused tail is masked out (never attended
    to, no position), so the one full forward compiles once instead of once per length.
    """
    import jax
    import jax.numpy as jnp

    from oxygen_jax.models import backbone
    from oxygen_jax.models.pi05 import model
    from oxygen_jax.models.pi05.spec import pi05_spec
    from oxygen_jax.nn.masks import last_valid_index, make_attn_mask, positions_from_mask

    prefix, input_mask, ar = model.embed_prefix(params, obs)
    prefix, input_mask = prefix[row:row + 1], input_mask[row:row + 1]
    cap = len(prompt) + num_tokens

    @jax.jit
    def next_logits(params, tail, n):  # tail int32 [cap], n valid entries
        emb = model.embed_tokens(params, tail[None]).astype(prefix.dtype)
        seq = jnp.concatenate([prefix, emb], 1)
        mask = jnp.concatenate([input_mask, (jnp.arange(cap) < n)[None]], 1)
        seq_ar = jnp.concatenate([ar, jnp.ones(cap, bool)])
        spec = pi05_spec(params.config)
        h, _ = backbone.forward_prefill(spec, params.vlm.layers, seq, positions_from_mask(mask),
                                        make_attn_mask(mask, seq_ar))
        last = last_valid_index(mask)[0]
        hn = model.final_norm(params, jax.lax.dynamic_slice_in_dim(h, last, 1, axis=1))
        return model.lm_logits(params, hn[:, 0])[0]

    tail = np.zeros(cap, np.int32)
    tail[: len(prompt)] = list(prompt)
    out, logits_all = [], []
    for i in range(num_tokens):
        logits = np.asarray(next_logits(params, tail, len(prompt) + i))
        logits_all.append(logits)
        out.append(int(np.argmax(logits)))
        if len(prompt) + i < cap:
            tail[len(prompt) + i] = out[-1]
    return out, np.stack(logits_all)


MOT_IMAGE_TOKEN = 500  # the tiny MoT preset's image token id


def mot_prompt_rows() -> tuple[np.ndarray, np.ndarray]:
    """Three [B=3, P=12] prompt rows for the MoT tests: row 0 unpadded, row 1 left-padded, row 2 = row 1
    with junk ids under its mask. Shared so test files reuse each other's compiled single-head programs."""
    img = MOT_IMAGE_TOKEN
    rows = np.asarray([
        [7, 8, 502, img, img, img, img, 503, 9, 10, 11, 12],
        [0, 0, 0, 7, 502, img, img, img, img, 503, 9, 10],
        [13, 14, 15, 7, 502, img, img, img, img, 503, 9, 10],
    ], np.int32)
    mask = np.ones(rows.shape, bool)
    mask[1:, :3] = False
    return rows, mask


def save_base(path, params):
    """A random base as `training.memory --base` and the commands take one: our checkpoint with the tokenizer its
    prompts are written in beside it (the offline demo tokenizer; a π base without one is refused)."""
    from oxygen_jax.ckpts import own
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer

    base = own.save_params(path, params)
    (Path(base).parent / "tokenizer.model").write_bytes(train_demo_tokenizer().to_bytes())
    return base
