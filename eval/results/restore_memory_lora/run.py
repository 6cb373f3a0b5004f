"""Peak memory of restoring an openpi checkpoint with LoRA (`load_openpi_params`, the run / serve path): this
checkout against another one (e.g. the commit before LoRA checkpoints streamed), each restore a fresh process.

    .venv/bin/python -m eval.results.restore_memory_lora.run --other /path/to/other/checkout [--work DIR]

The checkpoint: the `bench` preset's random weights with LoRA on both experts (rank 16 on the VLM, 32 on the
action expert, B random), in openpi's released layout, written by tests/test_lora.py's writer. Each child samples
its own VmRSS and RssAnon every 5 ms while it restores in float32 and in bfloat16 (the CPU layout, unstacked).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# Self-contained (not eval.restore_memory.PeakRss): it runs against the other checkout's code too.
CHILD = r"""
import json, sys, threading
sys.path.insert(0, {repo!r})
from oxygen_jax.ckpts.openpi import load_openpi_params
peak = {{"VmRSS": 0, "RssAnon": 0}}
stop = threading.Event()
def sample():
    while not stop.wait(0.005):
        for line in open("/proc/self/status"):
            k = line.split(":")[0]
            if k in peak:
                peak[k] = max(peak[k], int(line.split()[1]) // 1024)
t = threading.Thread(target=sample, daemon=True); t.start()
config, params = load_openpi_params({ckpt!r}, dtype={dtype!r})
stop.set(); t.join()
print(json.dumps({{"peak_vmrss_mib": peak["VmRSS"], "peak_rssanon_mib": peak["RssAnon"]}}))
"""


def _write(path: Path) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO))
    from test_lora import _random_b, _write_lora_checkpoint
    from oxygen_jax.models.pi05 import lora as pi05_lora
    from oxygen_jax.models.pi05.config import model_config
    from oxygen_jax.models.pi05.params import init_params

    params = init_params(model_config("bench"), 0)
    vlm = _random_b(pi05_lora.init_bank(params.config, 1, rank=16, seed=1), 2).adapter(1)
    act = _random_b(pi05_lora.init_bank(params.config.action_expert, 1, rank=32, seed=3), 4).adapter(1)
    _write_lora_checkpoint(path, params, pi05_lora.ModelLora(vlm=vlm, action_expert=act), training_layout=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other", type=Path, required=True, help="another checkout of the repository to compare with")
    ap.add_argument("--work", type=Path, default=Path("/tmp/restore_memory_lora"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "summary.json")
    args = ap.parse_args()
    ckpt = args.work / "params"
    if not ckpt.is_dir():
        _write(ckpt)
    rev = lambda repo: subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,  # noqa: E731
                                      text=True).stdout.strip()
    runs = []
    for _ in range(2):
        for repo in (REPO, args.other):
            for dtype in ("float32", "bfloat16"):
                code = CHILD.format(repo=str(repo), ckpt=str(ckpt), dtype=dtype)
                out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     cwd=str(repo)).stdout
                runs.append({"checkout": rev(repo), "dtype": dtype, **json.loads(out.strip().splitlines()[-1])})
                print(json.dumps(runs[-1]), flush=True)
    args.out.write_text(json.dumps({"runs": runs, "load_after": [round(x, 2) for x in os.getloadavg()]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
