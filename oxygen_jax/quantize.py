"""Quantizes a π0.5 / π0 checkpoint's layer weights to int8 or fp8 and writes it in our format.

    python -m oxygen_jax.quantize --ckpt DIR --out DIR --weights int8|fp8 [--layers attn mlp adanorm]

`--ckpt` is any π0.5 / π0 checkpoint `load_model` reads (ours or openpi's, either layout), restored in
float32 with its layers stacked. The attention projections, the MLPs and / or the adaptive norms'
modulation projections (`--layers`, default all three) of every layer stack (the VLM expert, the action
expert, SigLIP) become `nn.quant.QArray`s with per-output-channel scales (`nn.quant.RULES`); embeddings,
norm scales, biases and the projections outside the stacks are written as they are. The result is an `own.save_params` directory (fingerprinted by its
checksums) with the source's `assets/` (norm stats) and `tokenizer.model` copied beside it, so `run`,
`serve` and `load_model` take it like the source: `own.restore_params` returns the quantized leaves,
and the layer loop dequantizes them (docs/quantization.md).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from oxygen_jax.ckpts.adapters import base_fingerprint
from oxygen_jax.ckpts.load import TOKENIZER_FILE, find_tokenizer, load_model
from oxygen_jax.ckpts.orbax_io import CheckpointError
from oxygen_jax.ckpts.own import save_params
from oxygen_jax.cli import OneLineParser, existing
from oxygen_jax.nn import quant


def quantize_checkpoint(ckpt: Path, out: Path, weights: quant.WeightDType, layers=quant.KINDS, *,
                        overwrite: bool = False) -> dict:
    """Reads `ckpt`, quantizes it and writes `out` (with `assets/` and the tokenizer); returns a summary dict."""
    t0 = time.perf_counter()
    # "gpu": the stacked layout whatever this machine is (quantized leaves are stacked [L, ...] on disk).
    # Handed over without a reference kept here, so each float leaf is freed once quantized.
    params = quant.quantize_tree(load_model(ckpt, family="pi05", dtype="float32", backend="gpu").params, weights,
                                 tuple(layers))
    provenance = {"source": str(Path(ckpt).expanduser().resolve()), "source_fingerprint": base_fingerprint(ckpt),
                  "layers": list(layers), "tool": "python -m oxygen_jax.quantize"}
    dest = save_params(out, params, overwrite=overwrite, provenance=provenance)
    src = Path(ckpt).expanduser().resolve()
    assets = next((d / "assets" for d in (src, src.parent) if (d / "assets").is_dir()), None)
    if assets is not None:
        shutil.copytree(assets, dest / "assets", dirs_exist_ok=True)
    tokenizer = find_tokenizer(src)
    if tokenizer is not None:
        shutil.copy2(tokenizer, dest / TOKENIZER_FILE)
    return {"out": str(dest), "weights": weights, "layers": list(layers), "float32_bytes": quant.float_bytes(params),
            "quantized_bytes": quant.weight_bytes(params), "seconds": time.perf_counter() - t0,
            "assets": assets is not None, "tokenizer": tokenizer is not None}


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m oxygen_jax.quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, type=existing("dir"), help="a π0.5 / π0 checkpoint (ours or openpi's)")
    ap.add_argument("--out", required=True, type=Path, help="the new checkpoint directory")
    ap.add_argument("--weights", required=True, choices=sorted(quant.STORED_DTYPE),
                    help="int8 (symmetric absmax per output channel) or fp8 (float8 e4m3, per-channel scale)")
    ap.add_argument("--layers", nargs="+", default=list(quant.KINDS), choices=quant.KINDS,
                    help="which layer weights: attention projections, MLPs, adaptive norms' modulation projections "
                         "(default all)")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(argv)
    if args.out.exists() and not args.overwrite:
        ap.error(f"argument --out: {args.out} exists (pass --overwrite to replace it)")
    try:
        s = quantize_checkpoint(args.ckpt, args.out, args.weights, tuple(dict.fromkeys(args.layers)),
                                overwrite=args.overwrite)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"python -m oxygen_jax.quantize: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"{s['weights']} ({', '.join(s['layers'])}): weights {s['float32_bytes'] / 2**20:.1f} MiB in float32 -> "
          f"{s['quantized_bytes'] / 2**20:.1f} MiB; wrote {s['out']} in {s['seconds']:.1f} s"
          + ("" if s["assets"] else "; the source has no assets/ (norm stats)")
          + ("" if s["tokenizer"] else f"; no {TOKENIZER_FILE} found beside the source"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
