"""Quantizes a π0.5 / π0 checkpoint's weights to int8 or fp8 and writes it in our format.

    python -m oxygen_jax.quantize --ckpt DIR --out DIR --weights int8|fp8 [--layers attn mlp adanorm embed]

`--ckpt` is any π0.5 / π0 checkpoint `load_model` reads (ours, openpi's in either layout, a LeRobot policy). An
orbax source (ours, or openpi's, its LoRA merged layer by layer) is read one leaf at a time, a layer stack one layer
at a time (`ckpts.leaf_stream`), a LeRobot policy's memory-mapped safetensors converted one leaf (layer) at a time
(`ckpts.lerobot.float_leaf_reader`), and each leaf quantized as it arrives, so the float32 model is never held.
The attention projections, the MLPs and / or the
adaptive norms' modulation projections (`--layers`, default all three) of every layer stack (the VLM expert,
the action expert, SigLIP), and with `embed` the token embedding (the tied LM head, one scale per vocabulary
row), become `nn.quant.QArray`s (`nn.quant.RULES`); norm scales, biases and the projections outside the stacks
are written as they are, in float32. The result is an `own.save_params` directory (fingerprinted by its
checksums) with the source's `assets/` (norm stats), a LeRobot policy's processor files (`lerobot_io/`: its
statistics, chunk and prompt lengths) and `tokenizer.model` copied beside it, so `run`, `serve` and `load_model`
take it like the source (docs/quantization.md).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

from oxygen_jax.ckpts import lerobot, openpi, openpi_fast, own
from oxygen_jax.ckpts.adapters import base_fingerprint
from oxygen_jax.ckpts.leaf_stream import aligned_empty, mapped_pieces
from oxygen_jax.ckpts.load import TOKENIZER_FILE, base_tokenizer, load_model, source_kind
from oxygen_jax.ckpts.orbax_io import CheckpointError
from oxygen_jax.ckpts.own import save_flat, stored_config
from oxygen_jax.cli import OneLineParser, add_vision_heads_flag, existing
from oxygen_jax.models.pi05.config import ModelConfig
from oxygen_jax.models.pi05.params import LAYER_STACKED, abstract_params, openpi_shapes, to_openpi_dict
from oxygen_jax.nn import quant


def quantize_checkpoint(ckpt: Path, out: Path, weights: quant.WeightDType, layers=quant.KINDS, *,
                        overwrite: bool = False, stream: bool = True, vision_heads: int | None = None) -> dict:
    """Reads `ckpt`, quantizes it and writes `out` (with `assets/` and the tokenizer); returns a summary dict.

    `stream` (default): an orbax source (ours, or openpi's with its LoRA merged per layer) or a LeRobot policy is
    read one leaf, a stacked leaf one layer, at a time and each quantized as it arrives (`_streamed`), so the
    float32 model is never held; `stream=False` (or an openpi item without an OCDBT manifest) restores it whole.
    Both write the same arrays (tests/test_quant.py). `vision_heads`: a LeRobot source's SigLIP head count when
    it is not So400m (no tensor stores it).
    """
    t0 = time.perf_counter()
    src = Path(ckpt).expanduser().resolve()
    kind = source_kind(src)
    if vision_heads is not None and kind != "lerobot":  # never ignored
        raise ValueError(f"--vision-heads sizes the SigLIP of a LeRobot policy; {src} is not one ({kind} checkpoint): "
                         "drop --vision-heads")
    # LeRobot keeps its statistics, chunk and prompt lengths in its processor files, not assets/: checked first
    robot_files = lerobot.io_files(src) if kind == "lerobot" else []
    streamed = _streamed(ckpt, weights, tuple(layers), vision_heads) if stream else None
    if streamed is not None:
        flat, config = streamed
    else:
        # "gpu": the stacked layout whatever this machine is (quantized leaves are stacked [L, ...] on disk).
        # Handed over without a reference kept here, so each float leaf is freed once quantized.
        params = quant.quantize_tree(load_model(ckpt, family="pi05", dtype="float32", backend="gpu",
                                                 vision_heads=vision_heads).params, weights,
                                     tuple(layers))
        flat, config = to_openpi_dict(params), params.config
        del params
    provenance = {"source": str(src), "source_fingerprint": base_fingerprint(ckpt),
                  "layers": list(layers), "tool": "python -m oxygen_jax.quantize"}
    dest = save_flat(out, flat, config, overwrite=overwrite, provenance=provenance, lean=streamed is not None)
    assets = next((d / "assets" for d in (src, src.parent) if (d / "assets").is_dir()), None)
    if assets is not None:
        shutil.copytree(assets, dest / "assets", dirs_exist_ok=True)
    if robot_files:
        (dest / lerobot.IO_FOLDER).mkdir()
        for f in robot_files:
            shutil.copyfile(f, dest / lerobot.IO_FOLDER / f.name)
    tokenizer, _ = base_tokenizer(src)  # beside it, or a LeRobot folder's tokenizer/
    if tokenizer is not None:
        shutil.copy2(tokenizer, dest / TOKENIZER_FILE)
    return {"out": str(dest), "weights": weights, "layers": list(layers), "float32_bytes": quant.float_bytes(flat),
            "quantized_bytes": quant.weight_bytes(flat), "seconds": time.perf_counter() - t0,
            "assets": assets is not None, "tokenizer": tokenizer is not None, "streamed": streamed is not None,
            "lerobot_io": bool(robot_files)}


def _leaf_reader(ckpt: Path, vision_heads: int | None = None):
    """`(config, read)` of a float π0.5 / π0 source read leaf by leaf (`own` / `openpi` / `lerobot.float_leaf_reader`),
    or None for a source restored whole."""
    kind = source_kind(ckpt)
    if kind == "checkpoint":
        stored = stored_config(ckpt)
        if stored is None:
            return None
        # As `load_model(ckpt, dtype="float32")` restores it (the quantized copy's config is that one).
        return own.float_leaf_reader(ckpt, stored.replace(dtype="float32", prompt_attention="bidirectional"))
    if kind == "openpi" and not openpi_fast.is_fast_checkpoint(ckpt):
        return openpi.float_leaf_reader(ckpt, "float32")
    if kind == "lerobot":  # model.safetensors memory-mapped, each leaf (layer) converted as it is read
        return lerobot.float_leaf_reader(ckpt, "float32", vision_heads=vision_heads)
    return None


def _streamed(ckpt: Path, weights: quant.WeightDType, kinds: tuple,
              vision_heads: int | None = None) -> tuple[dict, ModelConfig] | None:
    """({openpi path: float32 array or `QArray` of host arrays}, config) with every leaf `quant.plan` would select
    quantized as it is read: a layer stack one layer at a time (the same per-layer scales as quantizing it whole);
    None for a source that is not read leaf by leaf. Peak: the output plus one float32 leaf (layer)."""
    source = _leaf_reader(ckpt, vision_heads)
    if source is None:
        return None
    config, read = source
    names = to_openpi_dict(jax.tree_util.tree_map_with_path(lambda p, _: quant.path_str(p), abstract_params(config)))
    quant.plan(abstract_params(config), kinds)  # refuses unknown kinds as the in-memory path does
    flat = {}
    with mapped_pieces():  # each freed piece goes back to the system (leaf_stream)
        for k, shape in openpi_shapes(config).items():
            rule = quant.rule_for(names[k], len(shape), kinds)
            if rule is None:
                (flat[k],) = read(k, False)  # read to the end: the reader checks the leaf's digest after its last piece
                continue
            values = aligned_empty(shape, quant.STORED_DTYPE[weights])  # written without a copy (`own.save_flat`)
            scale = np.empty(quant.scale_shape(shape, rule.axes), np.float32)
            per_layer = k in LAYER_STACKED
            for i, piece in enumerate(read(k, per_layer)):
                q = quant.quantize(piece, weights, rule.axes)
                if per_layer:
                    values[i], scale[i] = q.values, q.scale
                else:
                    values[...], scale[...] = q.values, q.scale
                del piece, q
            flat[k] = quant.QArray(values=values, scale=scale)
    return flat, config


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m oxygen_jax.quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, type=existing("dir"), help="a π0.5 / π0 checkpoint (ours or openpi's)")
    ap.add_argument("--out", required=True, type=Path, help="the new checkpoint directory")
    ap.add_argument("--weights", required=True, choices=sorted(quant.STORED_DTYPE),
                    help="int8 (symmetric absmax per output channel) or fp8 (float8 e4m3, per-channel scale)")
    ap.add_argument("--layers", nargs="+", default=list(quant.KINDS), choices=quant.ALL_KINDS,
                    help="which weights: attention projections, MLPs, adaptive norms' modulation projections (default "
                         "these three), embed: the token embedding / tied LM head, per vocabulary row (float unless named)")
    add_vision_heads_flag(ap)
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(argv)
    if args.out.exists() and not args.overwrite:
        ap.error(f"argument --out: {args.out} exists (pass --overwrite to replace it)")
    try:
        s = quantize_checkpoint(args.ckpt, args.out, args.weights, tuple(dict.fromkeys(args.layers)),
                                overwrite=args.overwrite, vision_heads=args.vision_heads)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"python -m oxygen_jax.quantize: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"{s['weights']} ({', '.join(s['layers'])}): weights {s['float32_bytes'] / 2**20:.1f} MiB in float32 -> "
          f"{s['quantized_bytes'] / 2**20:.1f} MiB; wrote {s['out']} in {s['seconds']:.1f} s"
          + ("" if s["streamed"] else " (source restored whole: an openpi item without an OCDBT manifest)")
          + ("; LeRobot's robot I/O (its processor files) copied" if s["lerobot_io"] else
             "" if s["assets"] else "; the source has no assets/ (norm stats)")
          + ("" if s["tokenizer"] else f"; no {TOKENIZER_FILE} found beside the source"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
