"""One loader for every command: a model's parameters from a preset or any checkpoint directory.

`load_model` is what `python -m oxygen_jax.run`, `python -m oxygen_jax.serve` and `python -m eval.bench`
call to get a model; it returns the parameters laid out for the backend (`for_backend`) with what the
caller needs beside them (`LoadedModel`). Sources:

| source | how it is recognised | config | params |
|---|---|---|---|
| `preset="tiny"`, `"bench"`, `"pi05"` or a `ModelConfig` | (no directory) | `ModelConfig` | π0.5 `Params`, random |
| `preset=` a `mot.ModelSpec` | (no directory) | `ModelSpec` | `mot.ModelParams`, random |
| our checkpoint (`own.save_params`) | a `config/` item | `ModelConfig` (stored dims) | π0.5 `Params` |
| Hugging Face Qwen3 / Qwen3-VL | `model.safetensors` (or its sharded index) | `ModelSpec` (language + `heads`) | `mot.ModelParams` |
| Hugging Face Qwen3.5 (`ckpts.qwen35`) | the same files, config.json `model_type` 'qwen3_5' | `ModelSpec` with `hybrid` (language + `heads`) | `mot.ModelParams` |
| Xiaomi-Robotics-0 (released layout, `ckpts.xr0`) | config.json `model_type` 'mibot' | `ModelSpec` (its XR0 head + language) | `mot.ModelParams` |
| StarVLA QwenPI_v3 / QwenGR00T (`ckpts.starvla`) | config.yaml `framework.name` + `qwen_vl_interface.model.*` weights | `ModelSpec` (its head + language) | `mot.ModelParams` |
| openpi checkpoint (either layout) | an orbax item or `params/` | `ModelConfig` (inferred; π0 by `state_proj`) | π0.5 / π0 `Params` (LoRA merged) |
| openpi π0-FAST (`ckpts.openpi_fast`) | the same, without action projections | `Pi0FastConfig` | `Pi0FastParams`; its FAST codec in `io` |
| LeRobot π0.5 / π0 (`ckpts.lerobot`) | config.json `type` 'pi05' / 'pi0' (or a `pretrained_model/` child) | `ModelConfig` (sizes from the tensors) | π0.5 / π0 `Params`; LeRobot's own I/O |

A directory that is none of these, or a model of another family than the caller drives (`family=`), is
a one-line ValueError naming the directory and what was expected. The tokenizer is looked for beside
the checkpoint (`find_tokenizer`: π0.5's `tokenizer.model`; a Qwen-vocabulary checkpoint's `tokenizer.json`),
the one place that does it, and a Qwen-vocabulary model's default stop ids are read from its files
(`ckpts.stop_ids`: `generation_config.json`, `config.json`, `tokenizer_config.json`) into `ModelSpec.stop_ids`.
`LoadedModel.vla(num_steps)` is what the runtime drives, for every source (π0-FAST: its decoder writes the chunks,
`models.decoded_actions`, read with the checkpoint's FAST codec and the PaliGemma tokenizer), and `LoadedModel.io` what the
checkpoint says about its robot I/O (`robots.io.RobotIO`: tokenizer, normalisation, how the state enters,
prompt and image conventions, output transforms), so no command asks which family a model is. A π checkpoint
(openpi's, ours) needs its own PaliGemma tokenizer: without one `io.tokenizer` is None and `io.tokenizer_hint`
names the file to fetch (`command_model.tokenizers` refuses it in one line; the demo tokenizer serves the demo
and random presets only).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Literal, Sequence

import jax

from oxygen_jax.ckpts import hf
from oxygen_jax.ckpts import lerobot, openpi_fast, qwen35, safetensors, starvla, xr0
from oxygen_jax.ckpts.stop_ids import read_stop_ids
from oxygen_jax.ckpts.openpi import load_openpi_norm_stats, load_openpi_params
from oxygen_jax.ckpts.orbax_io import PathLike, is_pytree_item
from oxygen_jax.ckpts.own import restore_params, stored_config
from oxygen_jax.models import heads as hd
from oxygen_jax.models.decoded_actions import ActionStream, ChunkError
from oxygen_jax.models import mot
from oxygen_jax.models.heads import HeadSpec
from oxygen_jax.models.mot import ModelParams, ModelSpec
from oxygen_jax.models.pi05 import model as pi05_model
from oxygen_jax.models.pi05 import params as pi05_params
from oxygen_jax.models.pi05 import pi0_fast
from oxygen_jax.models.vla import MultiHead
from oxygen_jax.models.pi05.config import EOS_ID, DType, ModelConfig, PromptAttention, model_config
from oxygen_jax.robots import fast_prompt
from oxygen_jax.robots.config import RobotConfig
from oxygen_jax.robots.io import OPENPI_FAST_CAMERAS, OPENPI_FAST_ROBOTS, FastPreprocess, OpenpiPreprocess, RobotIO
from oxygen_jax.robots.lerobot import LeRobotPreprocess
from oxygen_jax.robots.native_prompts import find_beside
from oxygen_jax.robots.text_tokenizers import load_tokenizer
from oxygen_jax.robots.normalize import NormStats
from oxygen_jax.robots.tokenizer import PALIGEMMA_TOKENIZER_URL

Family = Literal["pi05", "multihead", "pi0_fast"]
Source = Literal["preset", "checkpoint", "openpi", "hf", "xr0", "starvla", "lerobot"]

FAST_MAX_TOKENS = 256  # openpi's max_decoding_steps: the most tokens of a π0-FAST chunk
FAST_UNSHAPED = (32, 32)  # openpi's Pi0FASTConfig defaults (horizon, action dim): a chunk of no known shape, refused
TOKENIZER_FILE = "tokenizer.model"  # SentencePiece model with the PaliGemma id layout (`robots.tokenizer`)
_HF_FILES = ("model.safetensors", "model.safetensors.index.json")
_FAMILY_OF = {"preset": None, "checkpoint": "pi05", "openpi": "pi05", "lerobot": "pi05", "hf": "multihead", "xr0": "multihead",
              "starvla": "multihead"}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready for a command.

    Attributes:
      config: `ModelConfig` (π0.5), `mot.ModelSpec` (a backbone with heads and a language decoder) or
        `Pi0FastConfig` (π0-FAST).
      params: `Params`, `mot.ModelParams` or `Pi0FastParams`, layer stacks laid out for the backend (`for_backend`).
      family: "pi05", "multihead" or "pi0_fast" (which of the three the config and params are).
      source: "preset", "checkpoint" (ours), "openpi", "lerobot", "hf", "xr0" or "starvla".
      what: one line for messages, e.g. "random 'tiny' weights" or "openpi checkpoint /ckpts/pi05_libero".
      norm_stats: {"state", "actions": NormStats} from the checkpoint's `assets/`, or None.
      tokenizer: the checkpoint's tokenizer file (π0.5: `tokenizer.model`; Qwen vocabularies: `tokenizer.json`),
        or None (`text_tokenizer()` loads it).
      dataset_statistics: StarVLA's `dataset_statistics.json` as read (`starvla.action_stats` turns one
        entry into its q01 / q99 un-normalisation), or None.
      io: the checkpoint's robot I/O facts (`robots.io.RobotIO`), what the commands and the server read.
    """

    config: ModelConfig | ModelSpec
    params: Any
    family: Family
    source: Source
    what: str
    norm_stats: dict[str, NormStats] | None = None
    tokenizer: Path | None = None
    dataset_statistics: dict | None = None
    io: RobotIO = RobotIO()

    def vla(self, num_steps: int = 10, tokenizer=None, robot: RobotConfig | None = None) -> MultiHead:
        """The model as the runtime drives it (`Engine`, frame programs, the server). `num_steps`: π0.5's
        denoising steps (other heads carry their own, read from the checkpoint). `tokenizer`: π0-FAST reads its
        chunks with it (default: the checkpoint's own, `text_tokenizer()`). `robot`: π0-FAST's chunk shape when
        its FAST processor names none (openpi's universal one): the horizon of openpi's π0-FAST config for that
        robot (`RobotIO.robots`) and its action dim; without it such a model's chunks fail naming the fix."""
        if self.family == "pi0_fast":
            return pi0_fast.as_vla(self.params, self._fast_stream(tokenizer or self.text_tokenizer(), robot))
        if self.family == "pi05":
            return pi05_model.as_vla(self.params, num_steps)
        return MultiHead(self.params, self.config)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Where its language requests stop by default (π: EOS; others: the checkpoint's `eos_token_id`s)."""
        return self.io.stop_ids

    def _fast_stream(self, tok, robot: RobotConfig | None) -> ActionStream:
        codec = self.io.action_codec
        if codec is None:
            raise ValueError(f"{self.what} has no FAST processor folder (fast_tokenizer/) in or beside it: fetch "
                             f"{openpi_fast.FAST_TOKENIZER_HINT}")
        (h, a), why = self._chunk_shape(codec, robot)
        if tok is None:  # its prompts cannot be made either: `command_model.tokenizers` refuses it first
            why = f"no tokenizer to read FAST chunks with: pass {PALIGEMMA_TOKENIZER_HINT}"
        if why is None:
            return fast_action_stream(tok, codec, horizon=h, action_dim=a)

        def unreadable(_):
            raise ChunkError(why)
        return ActionStream(horizon=h, action_dim=a, stop_ids=(EOS_ID,), max_tokens=FAST_MAX_TOKENS, decode=unreadable)

    def _chunk_shape(self, codec, robot: RobotConfig | None) -> tuple[tuple[int, int], str | None]:
        """((Ha, Ad) of a π0-FAST chunk, None) or, with neither the processor nor a robot to give it, (openpi's
        default shape, why its chunks cannot be read). ValueError for a robot openpi has no π0-FAST config for."""
        if codec.horizon and codec.action_dim:
            return (codec.horizon, codec.action_dim), None
        fix = "add time_horizon and action_dim to its processor_config.json"
        if robot is None:
            return FAST_UNSHAPED, (f"{codec.source} names no chunk shape and no robot was given (LoadedModel.vla(robot=)),"
                                   f" so the chunk cannot be read: {fix}")
        if not codec.horizon and robot.name not in self.io.robots:
            raise ValueError(f"{codec.source} names no time_horizon and openpi has no π0-FAST config for robot "
                             f"{robot.name!r} (it has {sorted(self.io.robots)}): {fix}")
        r = self.io.robot(robot)
        return (codec.horizon or r.action_horizon, codec.action_dim or r.action_dim), None

    def text_tokenizer(self):
        """The tokenizer object of `tokenizer` (`text_tokenizers.load_tokenizer`), or None without one."""
        return None if self.tokenizer is None else load_tokenizer(self.tokenizer)


def fast_action_stream(tok, codec, *, max_tokens: int = FAST_MAX_TOKENS, horizon: int | None = None,
                       action_dim: int | None = None) -> ActionStream:
    """π0-FAST's chunks as the runtime reads them: stop at EOS or "|" (when the tokenizer spells it as one id),
    `fast_prompt.extract_actions` with `codec` (a `FastDecodeError` naming why a chunk is unreadable; never zeros).
    The chunk's shape: `horizon` / `action_dim` where given, else the processor's."""
    h, a = codec.shape(horizon, action_dim)
    bar = tok.encode(fast_prompt.END_MARK)
    stops = {tok.eos_id} | ({bar[0]} if len(bar) == 1 else set())
    return ActionStream(horizon=h, action_dim=a, stop_ids=tuple(sorted(stops)), max_tokens=max_tokens,
                        decode=functools.partial(fast_prompt.extract_actions, tok, codec, horizon=h, action_dim=a))


def find_tokenizer(*checkpoints: PathLike | None) -> Path | None:
    """The first `tokenizer.model` in or beside (in the parent of) each directory, in order; None if none.

    Our training runs and the demo keep it beside the base checkpoint (`out/base`, `out/tokenizer.model`).
    """
    return find_beside(TOKENIZER_FILE, *checkpoints)


def base_tokenizer(path: PathLike) -> tuple[Path | None, str | None]:
    """(the tokenizer found with a π checkpoint, what to fetch when there is none) without reading its weights:
    `tokenizer.model` in or beside it (and a LeRobot folder's `tokenizer/`). Not a π checkpoint: (None, None)."""
    p = Path(path).expanduser()
    kind = source_kind(p)
    if kind == "lerobot":
        d = lerobot.policy_dir(p)
        return find_tokenizer(d, d / "tokenizer", d.parent / "tokenizer"), PALIGEMMA_TOKENIZER_HINT
    if _FAMILY_OF[kind] == "pi05":
        return find_tokenizer(p), PALIGEMMA_TOKENIZER_HINT
    return None, None


def _text_dirs(path: Path, vlm_dir: Path | None) -> list[Path]:
    """Where a Qwen-vocabulary checkpoint's text files may be: its folder (a file's folder for a flat StarVLA
    checkpoint), then the base VLM's folder."""
    own = path if path.is_dir() else path.parent
    return [own] + ([vlm_dir] if vlm_dir is not None and vlm_dir != own else [])


def source_kind(path: PathLike) -> Source:
    """Which kind of checkpoint directory `path` is ("checkpoint", "xr0", "starvla", "lerobot", "hf" or "openpi"), from
    its files alone.

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: not a directory, or it holds none of the three kinds.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {p.resolve()}")
    if not p.is_dir():
        raise ValueError(f"checkpoint path is not a directory: {p.resolve()}")
    if (p / "config").is_dir():
        return "checkpoint"
    _refuse_incomplete(p)
    if xr0.is_xr0_dir(p):
        return "xr0"
    if starvla.is_starvla(p):  # before hf: a flat StarVLA directory holds model.safetensors too
        return "starvla"
    lerobot.refuse_unread(p)  # LeRobot's π0-FAST: named, not read as a Hugging Face backbone
    if lerobot.is_lerobot_dir(p):  # before hf: LeRobot's policy folder holds config.json and model.safetensors
        return "lerobot"
    if any((p / f).is_file() for f in _HF_FILES):
        return "hf"
    # An orbax item or a directory holding `params/` is read as openpi's: a damaged one (lost
    # _METADATA, garbled files) is then named by the openpi reader's CheckpointError.
    if (p / "params").exists() or is_pytree_item(p) or any(p.glob("ocdbt.process_*")) or (p / "manifest.ocdbt").exists():
        return "openpi"
    raise ValueError(
        f"{p.resolve()} holds no model checkpoint: expected an oxygen_jax checkpoint (config/ and params/), an openpi "
        f"checkpoint (params/ or an orbax item with _METADATA), a LeRobot π policy folder (config.json, "
        f"model.safetensors), a Xiaomi-Robotics-0 or StarVLA run, or a Hugging Face Qwen3 / Qwen3-VL / Qwen3.5 directory "
        f"(config.json and model.safetensors)")


# Tensor-name prefixes that tell a family's weights apart when the file naming the family is missing.
_WEIGHT_FAMILIES = (("Xiaomi-Robotics-0", ("dit.", "t_projector."), "config.json (model_type 'mibot')"),
                    ("StarVLA", (starvla.VLM,), "config.yaml (framework.name)"),
                    ("LeRobot π", ("model.paligemma_with_expert.",), "config.json (type 'pi05' or 'pi0')"))


def _refuse_incomplete(p: Path) -> None:
    """ValueError "<family> checkpoint missing <file>" for a folder whose weights are a family's but whose identifying
    file is absent (else it would be read as another kind and fail with that kind's message)."""
    if (p / "checksums").is_dir() and (p / "params").is_dir():
        raise ValueError(f"{p.resolve()}: an oxygen_jax checkpoint missing its config/ item (the stored ModelConfig); "
                         "copy the whole checkpoint folder")
    weights = p / "model.safetensors"
    if not weights.is_file():
        return
    try:
        names = [k for k in safetensors._header(weights)[0] if k != "__metadata__"]
    except (OSError, ValueError):
        return  # the reader of whatever kind it is names the damage
    for family, prefixes, needed in _WEIGHT_FAMILIES:
        file = needed.split(" ")[0]
        if any(n.startswith(prefixes) for n in names) and not (p / file).is_file():
            raise ValueError(f"{p.resolve()}: a {family} checkpoint missing {needed}; copy the whole checkpoint folder")


_PI_FLAGS = frozenset({"--adapter", "--prompt-attention"})
SOURCE_FLAGS = {  # what each kind of model is, and the model flags of the commands it takes (`command_model`)
    "checkpoint": ("an oxygen_jax π checkpoint", _PI_FLAGS),
    "openpi": ("an openpi π checkpoint", _PI_FLAGS),
    "lerobot": ("a LeRobot π checkpoint", _PI_FLAGS | {"--vision-heads"}),
    "xr0": ("a Xiaomi-Robotics-0 checkpoint with its own head", frozenset({"--action-mask"})),
    "starvla": ("a StarVLA checkpoint with its own head", frozenset()),
    "hf": ("a bare Qwen3 / Qwen3-VL / Qwen3.5 backbone", frozenset({"--heads", "--head-size"})),
    "preset": ("a π0.5 preset", _PI_FLAGS),
    "heads": ("a random Qwen3-VL backbone", frozenset({"--heads", "--head-size"})),
}


def dataset_key_refusal(ckpt: PathLike | None, *, demo: bool = False, heads: bool = False) -> str | None:
    """Why `--dataset-key` (the StarVLA `dataset_statistics.json` entry to un-normalise with) does not apply to this
    model, or None when it does (or when the directory is unreadable: the loader names what is wrong with it)."""
    what = "the demo is a π0.5 model" if demo else "the --heads model has random heads"
    if ckpt and not demo and not heads:
        try:
            kind = source_kind(ckpt)
        except (OSError, ValueError):
            return None
        if kind == "starvla" and starvla.statistics_file(ckpt).exists():
            return None
        what = ({"starvla": "this StarVLA run has no dataset_statistics.json",
                 "xr0": "a Xiaomi-Robotics-0 checkpoint has no dataset statistics"}.get(kind)
                or f"a {kind} checkpoint has no dataset statistics (π checkpoints read norm_stats.json from their assets)")
    elif not ckpt and not demo and not heads:
        what = "a preset has no dataset statistics"
    return (f"argument --dataset-key: only a StarVLA checkpoint with a dataset_statistics.json takes it (the entry to "
            f"un-normalise actions with); {what}: drop the flag")


def _random(preset: str | ModelConfig | ModelSpec, dtype: DType, prompt_attention: PromptAttention,
            seed: int) -> tuple[ModelConfig | ModelSpec, Any, str]:
    if isinstance(preset, ModelSpec):
        return preset, mot.init_model(preset, seed, dtype), f"random {preset.backbone.family} weights"
    if isinstance(preset, ModelConfig):
        cfg, what = preset, "random weights"
    else:
        cfg, what = model_config(preset, dtype=dtype, prompt_attention=prompt_attention), f"random '{preset}' weights"
    return cfg, pi05_params.init_params(cfg, seed), what


def _hf(path: Path, dtype: DType, heads: Sequence[HeadSpec], seed: int) -> tuple[ModelSpec, ModelParams]:
    if qwen35.is_qwen35_dir(path):
        ck = qwen35.load(path, dtype)
        spec = ModelSpec(backbone=ck.spec.backbone, hybrid=ck.spec, heads=tuple(heads), language=True,
                         image_token_id=ck.config.get("image_token_id"))
    else:
        ck = hf.load(path, dtype)
        spec = ModelSpec(backbone=ck.spec, heads=tuple(heads), language=True, image_token_id=ck.config.get("image_token_id"))
    heads_params = {h.name: hd.init_head(h, seed, dtype) for h in spec.heads}  # random: HF holds the backbone only
    return spec, ModelParams(decoder=ck.decoder, vision=ck.vision, heads=heads_params)


def _check_family(path: Path, source: Source, family: Family | None) -> None:
    have = _FAMILY_OF[source]
    if family is not None and have != family:
        label = {"checkpoint": "an oxygen_jax checkpoint", "openpi": "an openpi checkpoint",
                 "lerobot": "a LeRobot checkpoint",
                 "hf": "a Hugging Face checkpoint", "xr0": "a Xiaomi-Robotics-0 checkpoint",
                 "starvla": "a StarVLA checkpoint"}[source]
        needs = {"pi05": "a π0.5 model (an oxygen_jax or openpi checkpoint, or a π0.5 preset)",
                 "multihead": "a backbone with heads (a Hugging Face Qwen3 / Qwen3-VL directory or a ModelSpec)",
                 "pi0_fast": "a π0-FAST model (an openpi π0-FAST checkpoint)"}
        raise ValueError(f"{path} is {label} of a {have} model, but this command needs {needs[family]}")


def load_model(
    ckpt: PathLike | None = None,
    *,
    preset: str | ModelConfig | ModelSpec | None = None,
    family: Family | None = None,
    dtype: DType = "float32",
    prompt_attention: PromptAttention = "bidirectional",
    seed: int = 0,
    heads: Sequence[HeadSpec] = (),
    backend: str | None = None,
    action_mask=None,
    dataset_key: str | None = None,
    vision_heads: int | None = None,
) -> LoadedModel:
    """A model from a checkpoint directory or a preset (exactly one), restored once in `dtype`.

    Args:
      ckpt: a checkpoint directory of any kind in the module table (an openpi `params` item, a step
        directory or a checkpoint root; one of ours; a Hugging Face Qwen3 / Qwen3-VL directory; a released
        Xiaomi-Robotics-0 directory, restored with its head and a language decoder).
      preset: random weights instead: a π0.5 preset name (`model_config`), a `ModelConfig`, or a
        `mot.ModelSpec`; seeded by `seed`.
      family: the family the caller can drive ("pi05" or "multihead"); a checkpoint of the other
        family is refused before anything is read. None accepts either.
      dtype: every leaf's dtype ("float32" or "bfloat16"); for ours and openpi's also the config's.
      prompt_attention: π0.5 prompt attention of the result ("bidirectional" = openpi); ours keep
        their dimensions and take this and `dtype`.
      seed: random weights (presets, and the heads added on a Hugging Face backbone).
      heads: action heads put on a Hugging Face backbone, with random weights (the checkpoint holds
        the backbone only); the model always has a language decoder.
      backend: the layout `for_backend` picks (default: JAX's default backend).
      action_mask: XR0 only: the robot's [Ha, Ad] 0 / 1 mask (the released processor's
        `get_action_mask(robot_type)`, which sets the horizon too); default config.json's `action_mask`,
        else `action_length` with all ones (`ckpts.xr0`).
      dataset_key: StarVLA only: the `dataset_statistics.json` entry its actions are un-normalised with
        (`io.outputs`; default: its only entry).
      vision_heads: LeRobot only: SigLIP's attention heads when it is not LeRobot's So400m (no tensor stores them).

    Returns:
      A `LoadedModel`; its `params` are ready for the engine and the frame programs.

    Raises:
      FileNotFoundError: `ckpt` does not exist.
      CheckpointError: a damaged checkpoint (one line naming the file or leaf).
      ValueError: both or neither of `ckpt` / `preset`, a directory of no known kind, a model of
        another `family`, or keys and shapes that do not fit (one line first, details after).
    """
    if (ckpt is None) == (preset is None):
        raise ValueError("load_model needs a checkpoint directory or a preset (exactly one), got "
                         + ("both" if ckpt is not None else "neither"))
    norm_stats = tokenizer = stats = lerobot_io = fast_codec = None
    if preset is not None:
        if heads:
            raise ValueError("heads= puts random heads on a Hugging Face backbone; a ModelSpec preset names its own")
        have: Family = "multihead" if isinstance(preset, ModelSpec) else "pi05"
        if family is not None and have != family:
            raise ValueError(f"the preset is a {have} model, but this command needs a {family} model")
        config, params, what = _random(preset, dtype, prompt_attention, seed)
        source: Source = "preset"
    else:
        path = Path(ckpt).expanduser()
        source = source_kind(path)
        _check_family(path, source, family)
        if heads and source in ("xr0", "starvla"):
            raise ValueError(f"heads= puts random heads on a Hugging Face backbone; {path} is "
                             f"{'an XR0' if source == 'xr0' else 'a StarVLA'} checkpoint with its own head: drop heads=")
        if heads and source != "hf":
            raise ValueError(f"heads= puts random heads on a Hugging Face backbone; {path} is a π0.5 checkpoint")
        if vision_heads is not None and source != "lerobot":
            raise ValueError(f"vision_heads= sizes the SigLIP of a LeRobot checkpoint; {path} is a {source} checkpoint")
        if action_mask is not None and source != "xr0":
            raise ValueError(f"action_mask= is the robot's mask of an XR0 checkpoint; {path} is a {source} checkpoint")
        have = _FAMILY_OF[source]
        if source == "hf":
            config, params = _hf(path, dtype, heads, seed)
            what = f"Hugging Face {config.backbone.family} checkpoint {path}"
        elif source == "starvla":
            ck = starvla.load(path, dtype, language=True)
            config, params, stats = ck.spec, ck.params, ck.dataset_statistics
            what = f"StarVLA {ck.framework} checkpoint {path}"
        elif source == "xr0":
            ck = xr0.load(path, dtype, language=True, action_mask=action_mask)
            config, params = ck.spec, ck.params
            what = f"Xiaomi-Robotics-0 checkpoint {path}"
        elif source == "lerobot":
            ck = lerobot.load(path, dtype, vision_heads=vision_heads)
            config, params, lerobot_io = ck.config, ck.params, ck.io
            what = f"LeRobot {'π0.5' if config.variant == 'pi05' else 'π0'} checkpoint {ck.directory}"
        elif source == "checkpoint":
            stored = stored_config(path)
            config, params = restore_params(path, stored.replace(dtype=dtype, prompt_attention=prompt_attention))
            what = f"checkpoint {path}"
            if (path / lerobot.IO_FOLDER).is_dir():  # quantized from a LeRobot policy: its robot I/O came along
                lerobot_io = lerobot.read_io(path / lerobot.IO_FOLDER, weights=False)
                what += f" (LeRobot {'π0.5' if config.variant == 'pi05' else 'π0'} robot I/O)"
        elif openpi_fast.is_fast_checkpoint(path):
            if family is not None and family != "pi0_fast":
                raise ValueError(f"{path} is an openpi π0-FAST checkpoint (its actions are decoded FAST tokens), but "
                                 f"this command needs a {family} model")
            layout = "unstacked" if (backend or jax.default_backend()) == "cpu" else "stacked"
            fast = openpi_fast.load_openpi_fast(path, dtype=dtype, layout=layout)
            config, params, what, have, fast_codec = fast.config, fast.params, fast.what, "pi0_fast", fast.codec
        else:
            layout = "unstacked" if (backend or jax.default_backend()) == "cpu" else "stacked"  # streamed into it
            config, params = load_openpi_params(path, dtype=dtype, prompt_attention=prompt_attention, layout=layout)
            what = f"openpi checkpoint {path}"
        if source == "lerobot":  # statistics in its processor files (`lerobot_io`); the tokenizer beside it
            tokenizer, _ = base_tokenizer(path)
        elif source not in ("hf", "xr0", "starvla"):  # StarVLA's q01/q99 stats: ckpts.starvla.action_stats
            norm_stats = load_openpi_norm_stats(path)
            tokenizer = find_tokenizer(path)
        else:
            dirs = _text_dirs(path, ck.files["vlm_config"].parent if source == "starvla" else None)
            tokenizer = find_beside("tokenizer.json", *dirs)
            vocab = config.backbone.vocab_size
            stops = read_stop_ids(dirs, vocab, None if tokenizer is None else load_tokenizer(tokenizer))
            config = config.replace(stop_ids=stops)
    params = mot.for_backend(config, params, backend) if have == "multihead" else pi05_params.for_backend(params, backend)
    model = LoadedModel(config=config, params=params, family=have, source=source, what=what,
                        norm_stats=norm_stats, tokenizer=tokenizer, dataset_statistics=stats)
    return dataclasses.replace(model, io=_robot_io(model, dataset_key, lerobot_io, fast_codec))


PALIGEMMA_TOKENIZER_HINT = (f"tokenizer.model, PaliGemma's SentencePiece model (openpi downloads it from "
                            f"{PALIGEMMA_TOKENIZER_URL}; Hugging Face: google/paligemma-3b-pt-224)")
"""What to fetch for a π checkpoint without its tokenizer (openpi's checkpoints never ship it)."""


def _starvla_outputs(spec: ModelSpec, dataset_statistics: dict, key: str | None) -> dict:
    """head name -> StarVLA's deployment un-normalisation of one chunk [Ha, Ad] with one dataset's q01 / q99."""
    stats = starvla.action_stats(dataset_statistics, key)
    dims = stats["q01"].shape[0]
    for h in spec.heads:
        if h.action_dim < dims:
            raise ValueError(f"dataset_statistics.json has {dims} action dims but head {h.name!r} emits {h.action_dim}")
    return {h.name: (lambda chunk: starvla.unnormalize_actions(chunk[..., :dims], stats)) for h in spec.heads}


def _robot_io(model: LoadedModel, dataset_key: str | None = None, lerobot_io=None, fast_codec=None) -> RobotIO:
    """What `model`'s checkpoint says about its robot I/O (`robots.io.RobotIO`)."""
    if model.family == "pi0_fast":  # openpi π0-FAST: quantile stats, its prompt, the FAST codec, its camera layouts
        return RobotIO(tokenizer=model.tokenizer, tokenizer_hint=PALIGEMMA_TOKENIZER_HINT,
                       preprocess=FastPreprocess(model.norm_stats), action_codec=fast_codec, stop_ids=(EOS_ID,),
                       action_horizon=None if fast_codec is None else fast_codec.horizon, cameras=OPENPI_FAST_CAMERAS,
                       robots=OPENPI_FAST_ROBOTS)
    if lerobot_io is not None:  # LeRobot's own preprocessing, chunk length and prompt length
        return RobotIO(tokenizer=model.tokenizer, tokenizer_hint=PALIGEMMA_TOKENIZER_HINT,
                       preprocess=LeRobotPreprocess(lerobot_io), action_horizon=lerobot_io.chunk_size,
                       prompt_len=lerobot_io.tokenizer_max_length, stop_ids=(EOS_ID,))
    if model.family == "pi05":  # π0.5 / π0 (openpi's layout, ours, a random preset)
        pi0 = model.config.variant == "pi0"
        # openpi: π0 reads z-scored states through its state token and a prompt without the state.
        pre = OpenpiPreprocess(model.norm_stats, quantile=not pi0, state_in_prompt=False if pi0 else None)
        hint = None if model.source == "preset" else PALIGEMMA_TOKENIZER_HINT
        return RobotIO(tokenizer=model.tokenizer, tokenizer_hint=hint, preprocess=pre, stop_ids=(EOS_ID,))
    notes = []
    if model.source == "xr0" and model.config.heads[0].action_mask is None:
        h = model.config.heads[0]
        notes.append(f"XR0 checkpoint without an action mask: serving all {h.action_dim} dims over action_length = "
                     f"{h.horizon} steps. The released runtime multiplies the noisy action by the robot's mask at every "
                     "step (LIBERO: 7 of 32 dims, horizon 10); pass --action-mask with the processor's "
                     "get_action_mask(robot_type)")
    outputs = _starvla_outputs(model.config, model.dataset_statistics, dataset_key) if model.dataset_statistics else {}
    return RobotIO(tokenizer=model.tokenizer, norm_stats=model.norm_stats, stop_ids=model.config.stop_ids,
                   outputs=outputs, notes=tuple(notes))
