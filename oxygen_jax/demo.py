"""The embedded demo: a small trained π0.5, its "Memory: " adapter, tokenizer and held-out frames in one folder.

    checkpoints/demo/
      demo.json          manifest: the paths below, adapter name, request prompt, robot, Tp, token budget
      base/              `own.save_params` directory (SHA-256 per array)
      memory_adapter/    `ckpts.adapters.save_adapter` directory (tied to base/ by its fingerprint)
      tokenizer.model    SentencePiece, PaliGemma id layout
      frames/            PNG of both cameras per frame + frames.json (state, instruction, true labels)
      memory_eval.md     the held-out evaluation it was exported with (optional; summarised in demo.json)

Axes (`oxygen_jax.axes`): Px image side in pixels (of the stored LIBERO frames), Ds state dims (8 for LIBERO).

`load_demo` verifies every array on the way in; `normalize_answer` is the exact-match normal form its
answers are checked with. The folder is assembled by `python -m training.memory export-demo`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from oxygen_jax.ckpts import own
from oxygen_jax.ckpts.adapters import load_bank
from oxygen_jax.models import lora
from oxygen_jax.models.pi05.config import ModelConfig
from oxygen_jax.robots.config import RobotConfig, robot_config
from oxygen_jax.models.pi05.params import Params, for_backend
from oxygen_jax.robots.tokenizer import Tokenizer

DEMO_DIR = Path(__file__).resolve().parents[1] / "checkpoints" / "demo"
DEMO_MANIFEST = "demo.json"


@dataclasses.dataclass(frozen=True)
class Demo:
    """What `load_demo` returns.

    Attributes:
      params: the base model (`params.for_backend` form); config: its `ModelConfig`.
      tokenizer: the demo's SentencePiece model; robot: `robot_config("libero", max_token_len=prompt_len)`.
      bank, adapter_names: `Engine(params, cfg, tokenizer, bank=bank, adapter_names=adapter_names)`.
      prompt: the adapter's request prompt ("Memory: "); max_new_tokens: enough for every label + EOS.
      frames: held-out LIBERO frames (dicts: image / wrist_image uint8 [Px, Px, 3], state float32 [8],
        language_instruction, memory (the true label), scene, task, init_index, frame_key, predicted).
      manifest: demo.json.
    """

    params: Params
    config: ModelConfig
    tokenizer: Tokenizer
    robot: RobotConfig
    bank: lora.LoraBank
    adapter_names: tuple[str, ...]
    prompt: str
    max_new_tokens: int
    frames: list[dict]
    manifest: dict

    def vla(self, num_steps: int = 10):
        """The model the runtime drives (`models.vla.MultiHead` of the base, `num_steps` denoising steps)."""
        from oxygen_jax.models.pi05.model import as_vla

        return as_vla(self.params, num_steps)

    def samples(self) -> list[dict]:
        """The frames as openpi LIBERO client samples (`transforms.make_observation` input)."""
        return [{"observation/image": f["image"], "observation/wrist_image": f["wrist_image"],
                 "observation/state": f["state"], "prompt": f["language_instruction"]} for f in self.frames]


def load_demo(path: str | os.PathLike = DEMO_DIR) -> Demo:
    """Loads the embedded demo folder (default `checkpoints/demo`): checksummed base, adapter, tokenizer, frames."""
    from PIL import Image

    root = Path(path).expanduser().resolve()
    manifest_file = root / DEMO_MANIFEST
    if not manifest_file.is_file():
        raise FileNotFoundError(f"{root} is not a demo folder (no {DEMO_MANIFEST}); see checkpoints/demo/README.md")
    manifest = json.loads(manifest_file.read_text())
    config, params = own.restore_params(root / manifest["base"])
    tokenizer = Tokenizer.from_file(root / manifest["tokenizer"])
    bank, names = load_bank([root / manifest["adapter"]], config, base=root / manifest["base"])
    frames = []
    for row in json.loads((root / manifest["frames"]).read_text()):
        frame = dict(row)
        for key in ("image", "wrist_image"):
            frame[key] = np.asarray(Image.open(root / "frames" / row[key]).convert("RGB"))
        frame["state"] = np.asarray(row["state"], np.float32)
        frames.append(frame)
    return Demo(params=for_backend(params), config=config, tokenizer=tokenizer,
                robot=robot_config("libero", max_token_len=manifest["prompt_len"]), bank=bank, adapter_names=names,
                prompt=manifest["prompt"], max_new_tokens=manifest["max_new_tokens"], frames=frames, manifest=manifest)


def normalize_answer(text: str) -> str:
    """Exact-match normal form: strip, collapse whitespace, case-fold, one trailing period optional."""
    text = " ".join(str(text).split()).casefold()
    return text[:-1].rstrip() if text.endswith(".") else text
