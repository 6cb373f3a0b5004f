"""Prompts as the native processors build them: (images, state, instruction) -> token ids and pixels.

Xiaomi-Robotics-0 and StarVLA both hand a Qwen3-VL processor a chat-template text in which every image is
`<|vision_start|><|image_pad|><|vision_end|>`; the processor expands each `<|image_pad|>` to the image's
n = t · (H / patch) · (W / patch) / merge² tokens and patchifies the pixels (`qwen3_vl.patchify`). A row
here is a list of pieces, ("text", str) | ("special", name) | ("image", n), encoded piece by piece: a
Hugging Face tokenizer splits on its added (special) tokens before it runs BPE, so encoding the text
between them separately gives the ids of the whole string.

Client text is text: only the template's own ("special", name) and ("image", n) pieces become special
ids. A "text" piece (the instruction with the template's words around it) is encoded as plain text
(`ChatTokenizer.encode_text`): "open <|image_pad|> drawer" is the characters "<|image_pad|>", never an
image token, so a client cannot add images, end a turn or open a vision block. `encode` refuses, in
one line naming it, a text piece that a tokenizer still maps to one of the template's special ids (a
word-level vocabulary that holds "<|im_end|>" as a word).

Per family (what the native code writes; the instruction is the client's "prompt"):

* **XR0** (the released README / deploy server; the chat text is written out, not templated):

      <|im_start|>user\\nThe following observations are captured from multiple views.\\n
      # Base View\\n<VS><IMG×n><VE>\\n# Left-Wrist View\\n<VS><IMG×n><VE>\\n
      Generate robot actions for the task:\\n{instruction} /no_cot<|im_end|>\\n<|im_start|>assistant\\n<cot></cot><|im_end|>\\n

  one "# <camera> View" line per image in the robot's camera order (`VIEW_NAMES`); the state is not in
  the text (it is the DiT's state token).
* **StarVLA** (`build_qwenvl_inputs`: one {"type": "image"} per view, then the text, through
  `apply_chat_template(add_generation_prompt=True)`):

      <|im_start|>user\\n<VS><IMG×n><VE>…<VS><IMG×n><VE>{text}<|im_end|>\\n<|im_start|>assistant\\n

  QwenGR00T's text is the instruction (its state is a DiT token); QwenPI_v3 writes the state into it
  (`add_discretized_state_to_instruction`): f"{instruction} [STATE] {b_1 … b_Ds} [ACTION]" with
  b = digitize(state, linspace(-1, 1, 257)[:-1]) - 1 (`state_bins`; the state as normalised for training).
  No system turn is added (Qwen3-VL's template adds none when the messages have none; not checked against
  a released tokenizer here).

Rows are left-padded with the tokenizer's pad id (mask False): to the longest row, as StarVLA's
`padding=True` with `padding_side="left"` does, or to a fixed `prompt_len` so every frame has one shape.

The tokenizer is `QwenTokenizer`: the checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), found
by `find_tokenizer_json` in the checkpoint directory or its parent. Anything with `encode_text`,
`special_id` and `pad_id` works (the shared fixtures' processor used a synthetic word tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from oxygen_jax.models import mot
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.mot import ModelSpec
from oxygen_jax.robots.config import RobotConfig
from oxygen_jax.robots import transforms

FAMILIES = ("xr0", "starvla_qwenpi_v3", "starvla_gr00t")
# Qwen3-VL's added tokens; `pad` is Qwen's padding token.
SPECIAL_TOKENS = {"im_start": "<|im_start|>", "im_end": "<|im_end|>", "vision_start": "<|vision_start|>",
                  "vision_end": "<|vision_end|>", "image": "<|image_pad|>", "pad": "<|endoftext|>"}
VIEW_NAMES = {"base_0_rgb": "Base View", "left_wrist_0_rgb": "Left-Wrist View", "right_wrist_0_rgb": "Right-Wrist View"}
STATE_BINS = 256
TOKENIZER_FILE = "tokenizer.json"


class ChatTokenizer(Protocol):
    pad_id: int

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` as plain text: a special token's string is its characters, never its id."""

    def special_id(self, name: str) -> int: ...


class QwenTokenizer:
    """A Hugging Face `tokenizer.json` (Qwen3-VL's) through the `tokenizers` package.

    Text (`encode_text`, `encode`: instructions and language prompts) is encoded with the file's added
    tokens removed, so their strings are plain text (BPE pieces of "<", "|", ...); the template's special
    tokens come from `special_id`. Ids of text without an added token's string are the file's own.
    """

    def __init__(self, path: str | Path):
        try:
            import tokenizers
        except ImportError:
            raise ImportError("reading tokenizer.json needs the tokenizers package: pip install tokenizers") from None
        self.path = Path(path)
        self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        plain = json.loads(self._tok.to_str())
        self.added = {t["id"]: t["content"] for t in plain.get("added_tokens", [])}  # id -> string, never from text
        plain["added_tokens"] = []
        self._plain = tokenizers.Tokenizer.from_str(json.dumps(plain))
        pad = _configured_pad(self.path.parent / "tokenizer_config.json")
        self.pad_id = self._id(pad) if pad else self.special_id("pad")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.path} has no token {token!r} (a Qwen3-VL tokenizer.json has it as an added token)")
        return int(i)

    def special_id(self, name: str) -> int:
        return self._id(SPECIAL_TOKENS[name])

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` as plain text (added tokens' strings are characters). ValueError if the vocabulary
        still maps some of it to an added token (a model vocabulary that holds one as a word)."""
        ids = list(self._plain.encode(text, add_special_tokens=False).ids)
        hit = next((i for i in ids if i in self.added), None)
        if hit is not None:
            raise ValueError(f"the text holds {self.added[hit]!r}, a special token of {self.path.name}, which its "
                             "vocabulary cannot spell as plain text; remove it")
        return ids

    def encode(self, text: str) -> list[int]:
        """A language request's prompt ids: `encode_text` (plain text, no BOS)."""
        return self.encode_text(text)


def _configured_pad(path: Path) -> str | None:
    """tokenizer_config.json's pad_token (a string or {"content": ...}), if the file names one."""
    if not path.is_file():
        return None
    pad = json.loads(path.read_text()).get("pad_token")
    return pad.get("content") if isinstance(pad, Mapping) else pad


def find_beside(name: str, *dirs: str | Path | None) -> Path | None:
    """The first file `name` in or beside (in the parent of) each directory, in order; None if none."""
    for d in dirs:
        if d is None:
            continue
        d = Path(d).expanduser()
        for cand in (d / name, d.parent / name):
            if (cand.exists() or cand.is_symlink()) and not cand.is_dir():  # a device or broken link: refused when read
                return cand
    return None


def find_tokenizer_json(*dirs: str | Path | None) -> Path | None:
    """The first `tokenizer.json` in or beside each directory (`find_beside`)."""
    return find_beside(TOKENIZER_FILE, *dirs)


def family_of(spec: ModelSpec) -> str:
    """The prompt family of a model's primary head: XR0's joint DiT, or StarVLA's QwenPI_v3 / QwenGR00T."""
    kind = spec.heads[0].kind
    table = {"joint_kv": "xr0", "cross_hidden": "starvla_qwenpi_v3", "cross_last": "starvla_gr00t"}
    if kind not in table:
        raise ValueError(f"no native prompt layout for a {kind!r} head (XR0: joint_kv, StarVLA: cross_hidden / cross_last)")
    return table[kind]


def state_bins(state) -> np.ndarray:
    """StarVLA's `state2str_transform` bins, int [..., Ds]: 256 bins over [-1, 1); below -1 gives -1."""
    edges = np.linspace(-1.0, 1.0, STATE_BINS + 1)[:-1]
    return (np.digitize(np.asarray(state, np.float64), edges) - 1).astype(np.int32)


def starvla_text(instruction: str, state=None) -> str:
    """The text StarVLA's processor sees: the instruction, with QwenPI_v3's discretised state when given."""
    if state is None:
        return instruction
    return f"{instruction} [STATE] {' '.join(str(int(b)) for b in state_bins(np.ravel(state)))} [ACTION]"


def _image(n: int) -> list:
    return [("special", "vision_start"), ("image", n), ("special", "vision_end")]


def pieces(family: str, instruction: str, image_tokens: Sequence[int], *, views: Sequence[str] = (),
           state=None) -> list[tuple[str, object]]:
    """The pieces of one row (module docstring): `image_tokens` n per image, in order; `views` the camera
    names of XR0's "# ... View" lines; `state` [Ds] for QwenPI_v3's text."""
    if family not in FAMILIES:
        raise ValueError(f"unknown prompt family {family!r}; expected one of {FAMILIES}")
    if family == "xr0":
        if len(views) != len(image_tokens):
            raise ValueError(f"XR0 names every view: {len(views)} view names for {len(image_tokens)} images")
        out = [("special", "im_start"), ("text", "user\nThe following observations are captured from multiple views.\n")]
        for v, n in zip(views, image_tokens):
            out += [("text", f"# {VIEW_NAMES.get(v, v)}\n"), *_image(n), ("text", "\n")]
        return out + [("text", f"Generate robot actions for the task:\n{instruction} /no_cot"), ("special", "im_end"),
                      ("text", "\n"), ("special", "im_start"), ("text", "assistant\n<cot></cot>"), ("special", "im_end"),
                      ("text", "\n")]
    if family == "starvla_qwenpi_v3" and state is None:
        raise ValueError("QwenPI_v3 writes the state into its prompt: pass state [Ds]")
    text = starvla_text(instruction, state if family == "starvla_qwenpi_v3" else None)
    out = [("special", "im_start"), ("text", "user\n")]
    for n in image_tokens:
        out += _image(n)
    return out + [("text", text), ("special", "im_end"), ("text", "\n"), ("special", "im_start"), ("text", "assistant\n")]


def _special_ids(tok: ChatTokenizer) -> dict[int, str]:
    """id -> string of the template's special tokens (`SPECIAL_TOKENS`) this tokenizer has."""
    out = {}
    for name, text in SPECIAL_TOKENS.items():
        try:
            out[int(tok.special_id(name))] = text
        except (KeyError, ValueError):  # a tokenizer without this token: nothing to guard
            continue
    return out


def encode(tok: ChatTokenizer, row: Sequence[tuple[str, object]]) -> list[int]:
    """Token ids of one row's pieces; ValueError when a "text" piece encodes to a special id (module docstring)."""
    ids: list[int] = []
    special = None
    for kind, value in row:
        if kind == "text":
            text = tok.encode_text(value)
            special = _special_ids(tok) if special is None else special
            hit = next((i for i in text if i in special), None)
            if hit is not None:
                raise ValueError(f"the prompt text encodes to {special[hit]!r} (id {hit}), a special token of the "
                                 "template; client text must be plain text: remove it")
            ids += text
        elif kind == "special":
            ids.append(tok.special_id(value))
        else:
            ids += [tok.special_id("image")] * int(value)
    return ids


def image_token_count(image_shape: Sequence[int], spec: ModelSpec) -> int:
    """n tokens of one [H, W, 3] image (a single frame: t = 1) after the 2x2 merge."""
    vspec = spec.backbone.vision
    side = vspec.patch_size * vspec.spatial_merge_size
    h, w = int(image_shape[0]), int(image_shape[1])
    if h % side or w % side:
        raise ValueError(f"image {h}x{w} is not a multiple of {side} px (patch x merge): resize it first")
    return (h // side) * (w // side)


@dataclasses.dataclass(frozen=True)
class NativeRows:
    """Left-padded rows. ids int32 [B, P], mask bool [B, P], images: uint8 [H, W, 3] in row-major
    (row, view) order (`mot.make_inputs` patchifies them), state float32 [B, Ds]."""

    ids: np.ndarray
    mask: np.ndarray
    images: list[np.ndarray]
    state: np.ndarray


def build_rows(family: str, spec: ModelSpec, tok: ChatTokenizer, rows: Sequence[Mapping], *,
               prompt_len: int | None = None, views: Sequence[str] = ()) -> NativeRows:
    """Rows of {"images": [uint8 [H, W, 3], ...], "instruction": str, "state": [Ds]}, left-padded.

    Raises:
      ValueError naming the row: a row longer than `prompt_len`, images the ViT cannot patch.
    """
    encoded, images, states = [], [], []
    for i, r in enumerate(rows):
        try:
            ims = [np.asarray(im) for im in r["images"]]
            n = [image_token_count(im.shape, spec) for im in ims]
            state = np.asarray(r["state"], np.float32).reshape(-1)
            encoded.append(encode(tok, pieces(family, r["instruction"], n, views=views or (), state=state)))
        except (KeyError, ValueError) as e:
            raise ValueError(f"row {i}: {e}") from e
        images += ims
        states.append(state)
    length = max(len(e) for e in encoded) if prompt_len is None else prompt_len
    ids = np.full((len(encoded), length), tok.pad_id, np.int32)
    mask = np.zeros((len(encoded), length), bool)
    for i, e in enumerate(encoded):
        if len(e) > length:
            raise ValueError(f"row {i}: the prompt has {len(e)} tokens but the row holds {length}; shorten the "
                             "instruction or raise the prompt length")
        ids[i, length - len(e):], mask[i, length - len(e):] = e, True
    transforms.check_token_ids(ids, spec.backbone.vocab_size, "tokenizer ids")
    width = max(s.shape[0] for s in states)
    state = np.zeros((len(states), width), np.float32)
    for i, s in enumerate(states):
        state[i, : s.shape[0]] = s
    return NativeRows(ids=ids, mask=mask, images=images, state=state)


def client_rows(robot: RobotConfig, samples: Sequence[Mapping], *, image_size: int | None = None,
                default_prompt: str | None = None) -> tuple[list[dict], tuple[str, ...]]:
    """openpi client dicts -> (`build_rows` rows, camera names): the state as the client sent it and the
    cameras in the robot's order. With `image_size`, every camera slot, each resized with padding to an
    `image_size` square (a camera the client did not send is black), so every frame has one shape (the
    serving layout); without it, only the cameras sent, at their size (sides must then be multiples of
    patch x merge, as after the processor's own resize)."""
    rows, views = [], None
    for i, sample in enumerate(samples):
        try:
            inp = transforms.robot_inputs(robot, sample, default_prompt=default_prompt)
        except ValueError as e:
            raise ValueError(f"sample {i}: {e}") from e
        cams = tuple(c for c in robot.cameras if image_size is not None or inp["image_masks"][c])
        if views is not None and cams != views:
            raise ValueError(f"sample {i} sends cameras {cams} but sample 0 sent {views}: one batch, one layout")
        views = cams
        ims = [np.asarray(inp["images"][c]) for c in cams]
        if image_size is not None:
            ims = [transforms.resize_with_pad(im[None], image_size, image_size)[0] if inp["image_masks"][c]
                   else np.zeros((image_size, image_size, 3), np.uint8) for c, im in zip(cams, ims)]
        rows.append({"images": ims, "instruction": inp["prompt"], "state": inp["state"]})
    return rows, views or ()


def template_tokens(family: str, tok: ChatTokenizer, image_tokens: Sequence[int], views: Sequence[str] = (),
                    state_dim: int = 0) -> int:
    """Tokens of a row with an empty instruction (the template, images included; QwenPI_v3: a state of
    `state_dim` zeros): what a fixed row length must hold beyond the instruction's own tokens."""
    state = np.zeros(state_dim, np.float32) if family == "starvla_qwenpi_v3" else None
    return len(encode(tok, pieces(family, "", image_tokens, views=views, state=state)))


def make_inputs(spec: ModelSpec, built: NativeRows) -> mot.PrefixInputs:
    """`mot.PrefixInputs` of built rows (pixels patchified, M-RoPE positions)."""
    if not isinstance(spec.backbone.vision, qwen3_vl.Qwen3VisionSpec):
        raise ValueError("native prompts carry images: the backbone needs a Qwen3-VL vision encoder")
    return mot.make_inputs(spec, built.ids, built.mask, built.images)
