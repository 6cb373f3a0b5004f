"""The model `run` and `serve` drive, from the flags they share: `--ckpt` of any kind, `--heads`, `--tokenizer`.

What each kind of `--ckpt` runs (`load`; the kind is read from the directory's files, `ckpts.load.source_kind`):

| `--ckpt` holds                              | without `--heads`                        | with `--heads KINDS`                        |
|---------------------------------------------|------------------------------------------|---------------------------------------------|
| π0.5 (openpi or oxygen_jax), or no `--ckpt` | π0.5: its action expert + language       | refused (its head is the action expert)     |
| Xiaomi-Robotics-0 or StarVLA                | its own head + language                  | refused (drop `--heads`)                    |
| a bare Qwen3 / Qwen3-VL / Qwen3.5 backbone  | language only: no action head, empty     | those heads sized to the backbone, random   |
|                                             | [0, Da] chunks                           | weights (`heads.presets.for_backbone`)      |
| nothing, `--heads`                          | —                                        | a random Qwen3-VL tiny / bench backbone     |

`--heads` is a comma list of head kinds (`xr0`, `starvla`, `gr00t`) at `--head-size tiny` or `bench`, or a
preset name: `tiny` / `bench` is all three kinds at that size (without `--ckpt`: `models.mot.preset`'s
Qwen3-VL model of that name). A Qwen3.5 backbone keeps no K/V in its linear-attention layers, so it takes
starvla and gr00t only.

Tokenizers (`tokenizers`): π0.5 reads a SentencePiece `tokenizer.model` (`--tokenizer`, else beside the
checkpoint, else the offline demo tokenizer). A Qwen-vocabulary model reads `--tokenizer` or the
`tokenizer.json` found in or beside its checkpoint; a random-weight preset uses the demo tokenizer; a
checkpoint without one has none: its observation prompts are encoded with the demo tokenizer as stand-in
ids, and language requests take token ids (`prompt_tokens`) only (`Tokenizers.note` says so in one line).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from oxygen_jax.models.heads.presets import KINDS

SIZES = ("tiny", "bench")

_FLAG_IS = {  # what each model flag is for, in its refusal
    "--heads": "random heads go on a bare Qwen3 / Qwen3-VL / Qwen3.5 backbone",
    "--head-size": "it sizes --heads KINDS",
    "--action-mask": "the robot's mask of a Xiaomi-Robotics-0 checkpoint",
    "--adapter": "π language adapters",
    "--prompt-attention": "π prompt attention (Qwen backbones are causal)",
    "--vision-heads": "SigLIP's head count of a LeRobot checkpoint whose SigLIP is not So400m",
}


@dataclasses.dataclass(frozen=True)
class Heads:
    """`--heads`: head kinds, and the preset name when it was given as one ('tiny' / 'bench')."""

    kinds: tuple[str, ...]  # in KINDS, distinct, in the order given (the first is the primary head)
    preset: str | None = None  # 'tiny' / 'bench': every kind at that size (without --ckpt: mot.preset(name))


def parse_heads(text: str) -> Heads:
    """'xr0,starvla' -> Heads(('xr0', 'starvla')); 'tiny' / 'bench' -> every kind at that size (argparse type)."""
    if text in SIZES:
        return Heads(tuple(KINDS), preset=text)
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"expected distinct head kinds from {', '.join(KINDS)} (comma-separated) or a "
                                         f"preset {' / '.join(SIZES)}, got {text!r}")
    return Heads(kinds)


def head_size(heads: Heads, size: str | None) -> str:
    """The scale of the heads: the preset's, else --head-size, else 'tiny' (a preset and another size: ValueError)."""
    if heads.preset and size and size != heads.preset:
        raise ValueError(f"--heads {heads.preset} is every head kind at size {heads.preset}: drop --head-size {size} or "
                         f"name the kinds (--heads {','.join(KINDS)} --head-size {size})")
    return heads.preset or size or "tiny"


def ckpt_kind(ckpt) -> str | None:
    """`source_kind` of --ckpt, or None without one or when the directory is unreadable (the loader names why)."""
    from oxygen_jax.ckpts.load import source_kind

    if ckpt is None:
        return None
    try:
        return source_kind(ckpt)
    except (OSError, ValueError):
        return None


DTYPES = ("auto", "float32", "bfloat16")


def resolve_dtype(dtype: str, backend: str | None = None) -> str:
    """--dtype: "auto" is bfloat16 on an accelerator (half the bytes every step reads) and float32 on a CPU (which
    computes bfloat16 no faster); "float32" / "bfloat16" as given."""
    if dtype != "auto":
        return dtype
    import jax

    return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"


def check_flags(ckpt, given) -> None:
    """Raises a one-line ValueError for the first flag of `given` (flag -> whether it was given) that the model
    --ckpt holds cannot take (the `_KINDS` table), before anything is loaded; an unreadable --ckpt is left to
    the loader, which names what is wrong with it (the table: `ckpts.load.SOURCE_FLAGS`)."""
    if given.get("--head-size") and not given.get("--heads"):
        raise ValueError("argument --head-size: it sizes --heads KINDS: give --heads or drop --head-size")
    from oxygen_jax.ckpts.load import SOURCE_FLAGS

    kind = ckpt_kind(ckpt) if ckpt else "heads" if given.get("--heads") else "preset"
    if kind is None:
        return
    what, takes = SOURCE_FLAGS[kind]
    for flag, on in given.items():
        if on and flag not in takes:
            subject = f"{ckpt} is" if ckpt else "the model is"
            raise ValueError(f"argument {flag}: {_FLAG_IS[flag]}; {subject} {what}: drop {flag}")


def load(ckpt, *, heads: Heads | None = None, size: str | None = None, preset: str | None = None,
         dtype: str = "float32", seed: int = 0, prompt_attention: str = "bidirectional", action_mask=None,
         dataset_key: str | None = None, vision_heads: int | None = None):
    """The `ckpts.load.LoadedModel` the module table names for these flags (heads: random, seeded by `seed`).

    Raises:
      ValueError / OSError: one line naming the flag or file (a preset with --ckpt, a kind the backbone cannot
        take, a damaged checkpoint).
    """
    from oxygen_jax.ckpts.load import load_model
    from oxygen_jax.models import mot

    if heads is not None and preset:
        raise ValueError("give --heads or --preset, not both (--heads names the model with several heads)")
    if ckpt is None and heads is None:
        return load_model(preset=preset or "tiny", dtype=dtype, prompt_attention=prompt_attention,
                          seed=seed)
    if ckpt is None:
        scale = head_size(heads, size)
        spec = mot.preset(scale)
        if not heads.preset:
            spec = spec.replace(heads=_sized(heads.kinds, spec.backbone, scale))
        return load_model(preset=spec, dtype=dtype, seed=seed)
    model = load_model(ckpt, dtype=dtype, prompt_attention=prompt_attention, seed=seed, action_mask=action_mask,
                       dataset_key=dataset_key, vision_heads=vision_heads)
    return with_heads(model, heads.kinds, head_size(heads, size), seed, dtype) if heads else model


def _sized(kinds, backbone, scale: str) -> tuple:
    from oxygen_jax.models.heads.presets import for_backbone

    return tuple(for_backbone(k, backbone, scale) for k in kinds)


def with_heads(model, kinds, scale: str, seed: int = 0, dtype: str = "float32"):
    """`model` (a bare backbone with language) with random heads of `kinds` sized to its backbone at `scale`;
    head weights depend on (seed, head name) only (`heads.init_head`), laid out for the backend."""
    import jax

    from oxygen_jax.models import heads as hd

    specs = _sized(kinds, model.config.backbone, scale)
    spec = model.config.replace(heads=specs)  # checks every head against the backbone
    layout = hd.unstack_head if jax.default_backend() == "cpu" else hd.stack_head
    params = dataclasses.replace(model.params, heads={h.name: layout(hd.init_head(h, seed, dtype)) for h in specs})
    return dataclasses.replace(model, config=spec, params=params,
                               what=f"{model.what} + random {', '.join(kinds)} heads ({scale})")


def read_action_mask(path) -> np.ndarray | None:
    """--action-mask read from .npy or .json (None without a path).

    The file must be a regular file (a device or a link to one is refused unopened) of at most
    `limits.MAX_CONFIG_BYTES`, holding a [Ha, Ad] array of 0 / 1 with Ha <= `limits.MAX_HORIZON` (the cap a
    config.json's horizon has too) and Ad <= `limits.MAX_ACTION_DIM`. Errors are one line naming the file.
    """
    from oxygen_jax.ckpts import limits

    if not path:
        return None
    path = Path(path)
    try:
        if path.suffix == ".npy":
            if not path.is_file():
                raise ValueError("not a regular file" if path.exists() else "no such file")
            if path.stat().st_size > limits.MAX_CONFIG_BYTES:
                raise ValueError(f"larger than {limits.MAX_CONFIG_BYTES} bytes")
            mask = np.load(path, allow_pickle=False)
        else:
            mask = limits.read_json(path)
        mask = np.asarray(mask, np.float64)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--action-mask {path}: cannot read a [Ha, Ad] array of 0 / 1 from it "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if mask.ndim != 2 or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"--action-mask {path}: expected a [Ha, Ad] array of 0 / 1, got shape {mask.shape}")
    if mask.shape[0] > limits.MAX_HORIZON or mask.shape[1] > limits.MAX_ACTION_DIM:
        raise ValueError(f"--action-mask {path}: shape {mask.shape} is above the caps of {limits.MAX_HORIZON} steps x "
                         f"{limits.MAX_ACTION_DIM} dims (oxygen_jax.ckpts.limits)")
    return mask.astype(np.float32)


DEMO_TOKENIZER = "demo"
"""`--tokenizer demo`: the offline demo tokenizer as an explicit stand-in (random weights, benchmarks)."""


@dataclasses.dataclass(frozen=True)
class Tokenizers:
    """What a command encodes with: `rows` for observation prompts, `text` for language requests and results
    (None: token ids only), and `note`, one line to show at start-up when the model has no tokenizer of its own."""

    rows: object
    text: object | None
    note: str | None = None


def tokenizers(model, path: str | Path | None = None) -> Tokenizers:
    """The tokenizers of `model` (`--tokenizer` `path`, else its checkpoint's, `model.io.tokenizer`).

    A model that needs its own tokenizer and has none (`model.io.tokenizer_hint`: a π checkpoint) is refused;
    a random preset encodes with the offline demo tokenizer; any other model without one takes token ids only.
    `path` "demo" (`DEMO_TOKENIZER`) asks for the demo tokenizer by name: stand-in ids for random weights saved as a
    checkpoint and for benchmarks.

    Raises:
      ValueError / OSError: an unreadable file, a π checkpoint without its tokenizer, or a tokenizer whose ids do
        not fit the model's vocabulary (one line).
    """
    from oxygen_jax.robots.text_tokenizers import check_vocabulary, load_tokenizer
    from oxygen_jax.robots.tokenizer import train_demo_tokenizer

    if str(path) == DEMO_TOKENIZER:  # asked for by name: stand-in ids for random weights and benchmarks
        demo = train_demo_tokenizer()
        return Tokenizers(demo, demo, note=f"--tokenizer {DEMO_TOKENIZER}: prompts are encoded with the offline demo "
                                           "tokenizer (stand-in ids, not the checkpoint's own)")
    path, io, vocab = path or model.io.tokenizer, model.io, model.vla().vocab_size
    if path:
        tok = load_tokenizer(path)
        check_vocabulary(tok, vocab, path)
        if io.tokenizer_hint is not None and tok.vocab_size != vocab:  # a π embedding has one row per piece
            raise ValueError(f"the tokenizer {path} has {tok.vocab_size} ids but the model's vocabulary is {vocab}: "
                             f"pass the checkpoint's own tokenizer with --tokenizer ({io.tokenizer_hint})")
        return Tokenizers(tok, tok)
    if io.tokenizer_hint:
        raise ValueError(f"{model.what} has no tokenizer in or beside it: fetch {io.tokenizer_hint} and pass "
                         "--tokenizer FILE (a wrong tokenizer gives wrong prompt ids, so wrong actions)")
    demo = train_demo_tokenizer()
    if model.source == "preset":
        return Tokenizers(demo, demo)
    return Tokenizers(demo, None, note=(
        f"{model.what}: no tokenizer.json in or beside it, so observation prompts are encoded "
        "with the offline demo tokenizer (stand-in ids) and language requests take token ids (prompt_tokens) only; "
        "pass --tokenizer tokenizer.json for text"))


def prompt_rows(model, tok, robot, image_size: int, prompt_len: int | None) -> dict:
    """The `serving.codec.make_codec` keywords of a Qwen-backbone model ({} for a SigLIP one): square image side,
    row length (default: the rows' image tokens, or the native prompt template, + 48) and the heads' own output
    transforms (`model.io.outputs`, e.g. StarVLA's un-normalisation)."""
    from oxygen_jax.robots import native_prompts as npr
    from oxygen_jax.robots.prompt_rows import image_tokens
    from oxygen_jax.serving.codec import native_family

    vla = model.vla()
    if vla.spec.input_kind == "observation":
        return {}
    spec, cams = vla.spec, len(robot.cameras)
    per_cam = image_tokens(spec, image_size)
    template = per_cam * cams
    if family := native_family(spec, tok):
        template = npr.template_tokens(family, tok, [per_cam] * cams, robot.cameras, robot.state_dim)
    rows = dict(image_size=image_size, prompt_len=prompt_len or template + 48)
    if rows["prompt_len"] <= per_cam * cams:
        raise ValueError(f"--prompt-len {rows['prompt_len']} leaves no prompt tokens after {per_cam * cams} image tokens")
    if model.io.outputs:
        rows["outputs"] = dict(model.io.outputs)
    return rows
