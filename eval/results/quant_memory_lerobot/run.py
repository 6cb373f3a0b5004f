"""Peak memory of `python -m oxygen_jax.quantize` on a LeRobot policy: streamed (the default) against the whole
restore it replaced, each in a fresh process.

    .venv/bin/python -m eval.results.quant_memory_lerobot.run [--layers 16] [--work DIR] [--out summary.json]

The policy folder is written by the LeRobot-layout writer of tests/test_lerobot_ckpt.py (random weights under
LeRobot's tensor names, its config.json and processor files) at the sizes below; every process samples its own
VmRSS and RssAnon (anonymous memory: what the float32 copy costs; the memory-mapped model.safetensors shows up
in VmRSS as reclaimable file pages) every 5 ms.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]
CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
from eval.restore_memory import PeakRss
from oxygen_jax.quantize import quantize_checkpoint
t0 = time.perf_counter()
with PeakRss(("RssAnon",)) as peak:
    s = quantize_checkpoint({src!r}, {out!r}, "int8", stream={stream}, overwrite=True, vision_heads={heads})
print(json.dumps({{"streamed": s["streamed"], "seconds": time.perf_counter() - t0, "peak_vmrss_mib": int(peak.peak),
                  "peak_rssanon_mib": int(peak.peaks["RssAnon"]), "float32_mib": s["float32_bytes"] / 2**20,
                  "quantized_mib": s["quantized_bytes"] / 2**20}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/tmp/quant_memory_lerobot"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "summary.json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO))
    from test_lerobot_ckpt import _write_folder

    dims = dict(D=1024, Da=512, L=args.layers, F=4096, Fa=2048, N=8, K=1, H=128, V=16384, W=384, Lv=4, Fv=1536, Nv=6,
                p=14, side=16, A=32)
    policy = args.work / "policy"
    if not (policy / "pretrained_model" / "model.safetensors").is_file():
        _write_folder(policy / "pretrained_model", "pi05", dims, np.random.default_rng(0))
    rows = []
    for stream in (True, False, True, False):
        code = CHILD.format(repo=str(REPO), src=str(policy), out=str(args.work / f"q_{stream}"), stream=stream,
                            heads=dims["Nv"])
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    size = (policy / "pretrained_model" / "model.safetensors").stat().st_size / 2**20
    load = [round(x, 2) for x in __import__("os").getloadavg()]
    args.out.write_text(json.dumps({"dims": dims, "safetensors_mib": size, "runs": rows, "load_after": load}, indent=1) + "\n")


if __name__ == "__main__":
    main()
