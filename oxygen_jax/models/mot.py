"""A model = one backbone + several action heads (+ a language decoder) over one shared prefix pass.

Each head declares what it reads (`HeadSpec.kv_layers` / `hidden_layers`); the language decoder
reads every layer's K/V and the last valid token's final-normed output. `prefix_pass` runs the
backbone once and keeps exactly the union of those reads; `run_heads` then prepares every head once
and denoises each from that one prefix. `sample_all` is both in one jittable program:

    inputs ──► prefix_pass (ViT + backbone, once) ──► Prefix ─┬─► XR0 head: tail-layer K/V ──► actions
                                                     (union of reads) ├─► QwenPI_v3 head: projected hidden ─► actions
                                                                      ├─► GR00T head: last hidden ──► actions
                                                                      └─► language decoder: all K/V + last hidden

A head's actions do not depend on which other heads share the program (tested bit for bit): a
single-head model (`ModelSpec.only`) keeps only that head's reads and gives the same actions.

Two input kinds, chosen by the backbone's vision encoder (`ModelSpec.input_kind`):

| backbone                                  | inputs                                 | prefix pass                       |
|-------------------------------------------|----------------------------------------|-----------------------------------|
| Qwen3 / Qwen3-VL (`Qwen3VisionSpec`, none) | `PrefixInputs` (`make_inputs`)         | ViT + DeepStack + M-RoPE, here    |
| Qwen3.5 (`ModelSpec.hybrid`)              | `PrefixInputs`, valid tokens contiguous | ViT, then `qwen35.prefix_pass`    |
| any with a `SiglipConfig` (π0.5's Gemma)  | `models.observation.Observation`       | `models.vision.siglip_prefix.prefix_pass` |

The backbone's layers are a `stack.Stack` chosen once from the spec (`ModelSpec.stack`: attention layers, or
Qwen3.5's hybrid stack); its weights, prefix pass and language decoder come from the stack, never from a kind test.

π0.5 is one instance: `models.pi05.model.as_model(params)` = its Gemma + SigLIP backbone and one
`adarms_joint` head "actions" (the action expert), the same arrays as its `Params`.

Language: `language_model(spec, params)` is the backbone as a `decoder.LanguageDecoder`; the decode slot
pool admits requests from the `Prefix` of a model with `language=True`. The whole fan-out frame
(prefix pass, every head, admission and a k-token burst on the donated pool) is `runtime.frame.frame_step`
of a `models.vla.MultiHead(params, spec)`; `runtime.frame` also has the isolated / parallel / shared_kv settings.

Axes (`oxygen_jax.axes`, plus those of `heads`): B batch, P prefix tokens, D VLM width, L layers,
K KV heads, H head dim, Ha horizon, Ad action dim, Ds state dim; Np image patches, Pd flattened
patch (`qwen3_vl`); Mr = 3 M-RoPE axes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models import backbone as bb
from oxygen_jax.models import decoder as dec
from oxygen_jax.models import heads as hd
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.qwen35 import model as qwen35
from oxygen_jax.models.qwen35 import decoder as qwen35_decoder
from oxygen_jax.models.vision import siglip_prefix
from oxygen_jax.models.backbone import BackboneSpec, Decoder, Qwen3VisionSpec, RopeSpec
from oxygen_jax.models.heads import HeadParams, HeadSpec
from oxygen_jax.models.observation import Observation
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.models.qwen35.model import Qwen35Spec
from oxygen_jax.models.vision.siglip import Siglip, SiglipConfig
from oxygen_jax.models.stack import AttentionStack, Stack
from oxygen_jax.nn.layers import stack_layers, unstack_layers

QWEN3_VL_IMAGE_TOKEN_ID = 151_655  # Qwen3-VL-4B-Instruct config.json `image_token_id`
QWEN35_IMAGE_TOKEN_ID = 248_056  # Qwen3.5's `image_token_id` (transformers' Qwen3_5Config; ../shared/docs/qwen35.md §2.4)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


class PrefixReads(NamedTuple):
    """What one prefix pass must keep (sorted, static)."""

    kv_layers: tuple[int, ...]  # backbone layers whose K/V are kept
    hidden_layers: tuple[int, ...]  # HF hidden_states indices kept
    last_hidden: bool  # the last valid token's final-normed output (language decoder)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A backbone, its action heads and whether a language decoder shares the prefix. Hashable and static."""

    backbone: BackboneSpec
    heads: tuple[HeadSpec, ...]
    language: bool = True  # keep every layer's K/V and the last hidden for text decoding
    image_token_id: int | None = None  # placeholder id of image tokens (Qwen3-VL backbones)
    hybrid: Qwen35Spec | None = None  # Qwen3.5: the hybrid stack, whose `.backbone` is `backbone`
    stop_ids: tuple[int, ...] = ()  # the language decoder's default stop set (a checkpoint's `eos_token_id`s;
    #   π0.5: its tokenizer's EOS); () = none: requests decode to their budget unless they name stops

    def __post_init__(self):
        _require(isinstance(self.backbone, BackboneSpec), f"ModelSpec.backbone must be a BackboneSpec, got {type(self.backbone).__name__}")
        self.stack.check_heads(self.backbone, self.heads)
        _require(bool(self.heads) or self.language, "ModelSpec needs at least one head or language=True")
        _require(self.stop_ids == dec.check_stop_ids(self.stop_ids, self.backbone.vocab_size),
                 f"ModelSpec.stop_ids must be a sorted tuple of distinct token ids, got {self.stop_ids}")
        names = [h.name for h in self.heads]
        _require(len(set(names)) == len(names), f"ModelSpec.heads must have distinct names, got {names}")
        for h in self.heads:
            h.check_backbone(self.backbone)
        if isinstance(self.backbone.vision, Qwen3VisionSpec):
            _require(self.image_token_id is not None and 0 <= self.image_token_id < self.backbone.vocab_size,
                     f"ModelSpec.image_token_id must be a token id < {self.backbone.vocab_size} for a vision backbone, "
                     f"got {self.image_token_id}")

    @property
    def stack(self) -> Stack:
        """The backbone's layer stack, the one place it is chosen: Qwen3.5's hybrid stack, or attention layers."""
        return AttentionStack(self.backbone) if self.hybrid is None else qwen35_decoder.HybridStack(self.hybrid)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.heads)

    @property
    def input_kind(self) -> str:
        """'observation' (a SigLIP backbone: `Observation` inputs) or 'tokens' (`PrefixInputs`)."""
        return "observation" if isinstance(self.backbone.vision, SiglipConfig) else "tokens"

    def head(self, name: str) -> HeadSpec:
        for h in self.heads:
            if h.name == name:
                return h
        raise ValueError(f"no head named {name!r}; this model has {self.names}")

    def reads(self) -> PrefixReads:
        """The union of what the heads and the language decoder read.

        Example: XR0 (K/V of layers 20..35) + QwenPI_v3 (hidden 1..36) + GR00T (hidden 36) +
        language on a 36-layer backbone -> kv 0..35, hidden 1..36, last hidden.
        """
        kv = set(self.stack.kv_layers) if self.language else {l for h in self.heads for l in h.kv_layers}
        hidden = {l for h in self.heads for l in h.hidden_layers}
        return PrefixReads(tuple(sorted(kv)), tuple(sorted(hidden)), self.language)

    def only(self, *names: str, language: bool = False) -> ModelSpec:
        """The same backbone with only the named heads (and by default no language decoder)."""
        return dataclasses.replace(self, heads=tuple(self.head(n) for n in names), language=language)

    def replace(self, **changes) -> ModelSpec:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# Parameters


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelParams:
    decoder: Decoder
    vision: qwen3_vl.Vision | Siglip | None  # by the backbone's vision spec (Qwen3-VL ViT or SigLIP)
    heads: dict[str, HeadParams]

    def only(self, *names: str) -> ModelParams:
        """The same backbone arrays with only the named heads' weights."""
        return dataclasses.replace(self, heads={n: self.heads[n] for n in names})


def _vision_spec(spec: ModelSpec) -> Qwen3VisionSpec | None:
    return spec.backbone.vision if isinstance(spec.backbone.vision, Qwen3VisionSpec) else None


def init_model(spec: ModelSpec, seed: int = 0, dtype: str = "float32") -> ModelParams:
    """Random weights for the backbone, its vision encoder and every head (tests and benchmarks).

    Host-side numpy draws (no per-shape compiles); a head's weights depend on (seed, its name)
    only, so a single-head model built with `ModelParams.only` has the same weights.
    """
    return ModelParams(
        decoder=spec.stack.init(seed, dtype), vision=_vision_tree(spec, bb.numpy_draws(seed + 1, dtype)),
        heads={h.name: hd.init_head(h, seed, dtype) for h in spec.heads},
    )


def _vision_tree(spec: ModelSpec, draw: bb.Draw):
    vision = spec.backbone.vision
    if isinstance(vision, SiglipConfig):
        return siglip_prefix.siglip_tree(vision, spec.backbone.width, draw)
    return qwen3_vl.vision_tree(vision, draw) if isinstance(vision, Qwen3VisionSpec) else None


def abstract_model(spec: ModelSpec, dtype: str = "float32") -> ModelParams:
    """`jax.ShapeDtypeStruct` leaves of the whole model via `jax.eval_shape`: nothing is allocated."""
    return ModelParams(
        decoder=spec.stack.abstract(dtype), vision=jax.eval_shape(lambda: _vision_tree(spec, bb.zeros_draws(dtype))),
        heads={h.name: hd.abstract_head(h, dtype) for h in spec.heads},
    )


def for_backend(spec: ModelSpec, params: ModelParams, backend: str | None = None) -> ModelParams:
    """Layer stacks unstacked on the CPU backend (see `nn.layers.scan_layers`), stacked elsewhere; the decoder's
    as its stack lays them out (`Stack.lay_out`), the vision encoder's by its own `with_layers`."""
    cpu = (backend or jax.default_backend()) == "cpu"
    layers = unstack_layers if cpu else stack_layers
    vision = params.vision and params.vision.with_layers(layers)
    head = hd.unstack_head if cpu else hd.stack_head
    decoder = dataclasses.replace(params.decoder, layers=spec.stack.lay_out(params.decoder.layers, cpu))
    return ModelParams(decoder=decoder, vision=vision,
                       heads={n: head(p) for n, p in params.heads.items()})


# --------------------------------------------------------------------------------------------------
# Inputs and the prefix pass


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixInputs:
    """One batch of prompts (with images) for the prefix pass.

    Attributes:
      input_ids: int32 [B, P] with `image_token_id` placeholders where image tokens go.
      input_mask: bool [B, P] real tokens (left or right padding).
      positions: int32 [Mr, B, P] M-RoPE positions (or [B, P] for 1-D RoPE), padding at 0.
      next_position: int32 [B] max position + 1 per row.
      pixel_values: [Np, Pd] flattened patches of every image in row order, or None (text only).
      grid: static per-image (t, h, w) patch grids (`qwen3_vl.as_grid`).
    """

    input_ids: jax.Array
    input_mask: jax.Array
    positions: jax.Array
    next_position: jax.Array
    pixel_values: jax.Array | None = None
    grid: qwen3_vl.Grid = dataclasses.field(default=(), metadata=dict(static=True))


def make_inputs(spec: ModelSpec, input_ids, input_mask, images=()) -> PrefixInputs:
    """Host helper: patchify uint8 images [H, W, 3] (in row order) and compute positions.

    Each image needs t * h * w / m² consecutive `image_token_id` tokens in its row (`qwen3_vl`).
    """
    _require(spec.input_kind == "tokens", "this backbone has a SigLIP encoder: its inputs are models.observation.Observation "
             "(robots.transforms.make_observation), not mot.make_inputs")
    ids, mask = np.asarray(input_ids, np.int32), np.asarray(input_mask, bool)
    _require(ids.ndim == 2 and mask.shape == ids.shape, f"input_ids and input_mask must both be [B, P], got {ids.shape} and {mask.shape}")
    if ids.size:  # JAX would clamp an out-of-range embedding gather silently
        vocab = spec.backbone.vocab_size
        _require(ids.min() >= 0 and ids.max() < vocab, f"input_ids must lie in [0, {vocab}), got [{ids.min()}, {ids.max()}]")
    spec.stack.check_mask(mask)
    vspec = _vision_spec(spec)
    pixels, grid = None, ()
    if len(images):
        _require(vspec is not None, "images given but the backbone has no Qwen3-VL vision encoder")
        patches = [qwen3_vl.patchify(im, vspec) for im in images]
        pixels, grid = np.concatenate([p for p, _ in patches]), qwen3_vl.as_grid([g for _, g in patches])
    if spec.backbone.rope.kind == "mrope_interleaved":
        merge = vspec.spatial_merge_size if vspec else 1
        image_id = -1 if spec.image_token_id is None else spec.image_token_id
        positions, nxt = qwen3_vl.mrope_positions(ids, mask, grid or None, image_token_id=image_id, spatial_merge_size=merge)
    else:
        positions = np.where(mask, np.cumsum(mask, -1) - 1, 0).astype(np.int32)
        nxt = mask.sum(-1).astype(np.int32)
    return PrefixInputs(input_ids=jnp.asarray(ids), input_mask=jnp.asarray(mask), positions=jnp.asarray(positions),
                        next_position=jnp.asarray(nxt), pixel_values=None if pixels is None else jnp.asarray(pixels), grid=grid)


def prefix_pass(spec: ModelSpec, params: ModelParams, inputs: PrefixInputs | Observation) -> Prefix:
    """Runs vision and the backbone once and keeps the union of every reader's needs (`spec.reads()`).

    A SigLIP backbone (`spec.input_kind == "observation"`) takes an `Observation` and runs
    `siglip_prefix.prefix_pass` (π0.5's prefill); the rest of this docstring is the `PrefixInputs` path.

    The embedded prompt then runs through the layer stack (`ModelSpec.stack.prefix_pass`); attention layers
    reuse `backbone.prefill` (HF-convention hidden states in the backbone's `hidden_states` convention,
    `models.hidden_states`) with `keep_kv` / `keep_hidden`: K/V and hidden states nobody reads are never
    stored by the layer loop (stacked or unrolled).

    Returns:
      `prefix.Prefix` with K/V [Lk, B, P, K, H], hidden [Lh, B, P, D], the prefix mask,
      next positions and (with language) the last valid token's final-normed output [B, D].
    """
    bspec, decoder = spec.backbone, params.decoder
    reads = spec.reads()
    check_inputs(spec, inputs)
    if spec.input_kind == "observation":
        return siglip_prefix.prefix_pass(bspec, decoder, params.vision, inputs, kv_layers=reads.kv_layers,
                                         hidden_layers=reads.hidden_layers, last_hidden=reads.last_hidden)
    deepstack = None
    if inputs.pixel_values is not None:
        vspec = _vision_spec(spec)
        _require(vspec is not None and params.vision is not None, "pixel_values given but the model has no vision encoder")
        enc = qwen3_vl.encode(vspec, params.vision, inputs.pixel_values.astype(decoder.embedding.dtype), inputs.grid)
        x, image_mask = qwen3_vl.embed_multimodal(bspec, decoder, inputs.input_ids, enc["tokens"], spec.image_token_id)
        if enc["deepstack"].shape[0]:
            deepstack = qwen3_vl.scatter_deepstack(enc["deepstack"], image_mask)
    else:
        x = bb.embed_tokens(bspec, decoder, inputs.input_ids)
    return spec.stack.prefix_pass(decoder, x, inputs.positions, inputs.input_mask, inputs.next_position,
                                  kv_layers=reads.kv_layers, hidden_layers=reads.hidden_layers,
                                  last_hidden=reads.last_hidden, deepstack=deepstack)


def check_inputs(spec: ModelSpec, inputs) -> None:
    """Raises ValueError when `inputs` are not the backbone's input kind (`ModelSpec.input_kind`) or mis-shaped.

    Observations get every check of `observation.validate` (value checks only on concrete arrays);
    `PrefixInputs` ids are range-checked where they are built (`make_inputs`, on the host).
    """
    if spec.input_kind == "observation":
        if not isinstance(inputs, Observation):
            raise ValueError(f"this model's backbone has a SigLIP encoder and takes an Observation "
                             f"(robots.transforms.make_observation), got {type(inputs).__name__}")
        siglip_prefix.check_observation(spec.backbone, inputs)
        return
    if not isinstance(inputs, PrefixInputs):
        raise ValueError(f"this model takes mot.PrefixInputs (mot.make_inputs), got {type(inputs).__name__}")
    ids, mask = inputs.input_ids, inputs.input_mask
    _require(ids.ndim == 2 and mask.shape == ids.shape, f"input_ids and input_mask must both be [B, P], got {ids.shape} and {mask.shape}")


def language_model(spec: ModelSpec, params: ModelParams) -> dec.LanguageDecoder:
    """The model's language decoder (its backbone: embedder, layers, final norm, head) for the decode pool,
    with the spec's default stop ids: a `qwen35_decoder.HybridDecoder` for Qwen3.5, else an attention one.

    `decode.init_pool` / `admit` / `decode_burst` take it; they admit from the `Prefix` of a `prefix_pass`
    with `spec.language` (the K/V the decoder continues and the last hidden).
    """
    return spec.stack.language_model(params.decoder, spec.stop_ids)


def run_heads(spec: ModelSpec, params: ModelParams, prefix: Prefix, noises: dict[str, jax.Array],
              states: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """Every head of `spec` on one prefix: prepare once (per-frame precompute), then denoise.

    Args:
      noises: head name -> [B, Ha, Ad] noise; exactly the heads of `spec`.
      states: head name -> [B, Ds] robot state, for heads with a state token.
    Returns:
      head name -> actions float32 [B, Ha, Ad].
    """
    _require(set(noises) == set(spec.names), f"noises must be given for exactly the heads {spec.names}, got {tuple(noises)}")
    missing = [n for n in spec.names if n not in params.heads]
    _require(not missing, f"no weights for heads {missing}; the parameters have {tuple(params.heads)}")
    states = states or {}
    return {h.name: hd.sample(params.heads[h.name], h, prefix, noises[h.name], states.get(h.name)) for h in spec.heads}


@jax.jit
def sample_all(params: ModelParams, spec: ModelSpec, inputs: PrefixInputs, noises: dict[str, jax.Array],
               states: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """One prefix pass, then every head: `run_heads(prefix_pass(inputs))` as one compiled program.

    Compiles once per (spec, shapes); `spec` is static. Returns head name -> actions [B, Ha, Ad].
    """
    return run_heads(spec, params, prefix_pass(spec, params, inputs), noises, states)


# --------------------------------------------------------------------------------------------------
# Presets


def bench_backbone() -> BackboneSpec:
    """A Qwen3-VL-shaped backbone at our CPU `bench` scale: text 1024 x 8 (8 heads, 4 KV heads x 128,
    SwiGLU 4096, Qwen3-VL's vocabulary and M-RoPE), ViT 384 x 6 with DeepStack from blocks 1, 3, 5."""
    return BackboneSpec(
        family="qwen3_vl", width=1024, depth=8, num_heads=8, num_kv_heads=4, head_dim=128, mlp_dim=4096,
        vocab_size=151_936, mlp="swiglu", norm_plus_one=False, qk_norm=True,
        rope=RopeSpec(theta=5e6, kind="mrope_interleaved", mrope_section=(24, 20, 20)), embed_scale=False,
        tie_embeddings=True, vision=Qwen3VisionSpec(depth=6, width=384, num_heads=6, mlp_dim=1536, out_width=1024,
                                                    num_position_embeddings=2304, deepstack_layers=(1, 3, 5)),
    )


_HEADS = ("xr0", "starvla", "gr00t")


def preset(name: str) -> ModelSpec:
    """A named model.

    * 'tiny': `backbone.preset("qwen3vl_tiny")` + the three tiny heads + language (tests; image id 500).
    * 'bench': `bench_backbone()` + the three bench heads + language (CPU benchmarks).
    * 'full': Qwen3-VL-4B + XR0, QwenPI_v3 and GR00T heads + language (`eval_shape` only).
    * 'xr0', 'starvla_qwenpi_v3', 'gr00t': the published single-head models on Qwen3-VL-4B.
    * 'qwen35_tiny': `qwen35.preset("qwen35_tiny")` (8 layers, 6 of them linear) + the tiny QwenPI_v3 head
      reading its last 3 hidden states and GR00T its last + language (tests; image id 500).
    * 'qwen35_bench': `qwen35.preset("qwen35_bench")` + the bench QwenPI_v3 and GR00T heads + language.
    """
    # StarVLA's heads were trained on transformers 4.57's hidden states (`models.hidden_states`); XR0 reads K/V only.
    full = functools.partial(ModelSpec, backbone=bb.preset("qwen3_vl_4b").replace(hidden_states="transformers_4_57"),
                             image_token_id=QWEN3_VL_IMAGE_TOKEN_ID)
    if name == "tiny":
        return ModelSpec(backbone=bb.preset("qwen3vl_tiny"), heads=tuple(hd.preset(f"{h}_tiny") for h in _HEADS), image_token_id=500)
    if name == "bench":
        return ModelSpec(backbone=bench_backbone(), heads=tuple(hd.preset(f"{h}_bench") for h in _HEADS),
                         image_token_id=QWEN3_VL_IMAGE_TOKEN_ID)
    if name == "full":
        return full(heads=(hd.xr0(), hd.starvla_qwenpi_v3(), hd.gr00t()))
    if name in ("xr0", "starvla_qwenpi_v3", "gr00t"):
        return full(heads=(hd.preset(name),), language=False)
    if name == "qwen35_tiny":
        q = qwen35.preset("qwen35_tiny")
        depth = q.backbone.depth  # StarVLA's heads read hidden states only: QwenPI_v3 the last ones, GR00T the last
        heads = (hd.preset("starvla_tiny").replace(hidden_layers=tuple(range(depth - 2, depth + 1))),
                 hd.preset("gr00t_tiny").replace(hidden_layer=depth))
        return ModelSpec(backbone=q.backbone, hybrid=q, heads=heads, image_token_id=500)
    if name == "qwen35_bench":  # the bench heads fit its 8 layers as they fit bench_backbone()'s
        q = qwen35.preset("qwen35_bench")
        return ModelSpec(backbone=q.backbone, hybrid=q, heads=(hd.preset("starvla_bench"), hd.preset("gr00t_bench")),
                         image_token_id=QWEN35_IMAGE_TOKEN_ID)
    raise ValueError(f"unknown model preset {name!r}; choose one of ['bench', 'full', 'gr00t', 'qwen35_bench', "
                     f"'qwen35_tiny', 'starvla_qwenpi_v3', 'tiny', 'xr0']")
