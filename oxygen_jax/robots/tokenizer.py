"""PaliGemma SentencePiece tokenizer, π0/π0.5/OxyGen prompt formats and streaming detokenization.

Axes: T prompt tokens (`max_len`, the robot's `max_token_len`). Everything here runs on the host.

Special ids follow the Gemma/PaliGemma layout: pad 0, eos 1, bos 2, unk 3. The real model file is
`gs://big_vision/paligemma_tokenizer.model` (257,152 pieces); it is never downloaded here. Tests and
demo runs use `train_demo_tokenizer()`, a tiny BPE model with the same id layout trained in memory;
`train_text_tokenizer(texts)` trains one the same way on a task's own texts (the embedded demo's).

Prompt formats (`max_len` = 200 for openpi configs, 100 for OxyGen's):

    π0.5 action prompt   BOS "Task: pick up the cup, State: 12 128 255;\nAction: "
    π0 action prompt     BOS "pick up the cup" + "\n"     (state is None, e.g. pi05_libero)
    OxyGen text prompt   BOS "Task: pick up the cup. Subtask: "

Every prompt is padded with id 0 / mask False to `max_len`; longer prompts are truncated with a warning.
"""

from __future__ import annotations

import functools
import io
import os
import string
import warnings
from collections.abc import Sequence

import numpy as np
import sentencepiece as spm

PALIGEMMA_TOKENIZER_URL = "gs://big_vision/paligemma_tokenizer.model"

# -------------------------------------------------------------------------------------------------
# Tokenizer
# -------------------------------------------------------------------------------------------------


class Tokenizer:
    """A SentencePiece model with the PaliGemma id layout. Build with `from_file` or `from_bytes`."""

    def __init__(self, processor: spm.SentencePieceProcessor):
        self._sp = processor
        for name, value in (("pad", processor.pad_id()), ("eos", processor.eos_id()), ("bos", processor.bos_id())):
            if value < 0:
                raise ValueError(
                    f"tokenizer model defines no {name} id; prompts need pad/eos/bos "
                    f"(PaliGemma uses pad 0, eos 1, bos 2; real model: {PALIGEMMA_TOKENIZER_URL})"
                )

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> "Tokenizer":
        """Loads a serialized SentencePiece `ModelProto`."""
        if not isinstance(model_proto, (bytes, bytearray)) or not model_proto:
            raise ValueError("Tokenizer.from_bytes expects the non-empty bytes of a SentencePiece .model file")
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(bytes(model_proto))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"bytes are not a SentencePiece model ({e})") from e
        return cls(sp)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """Loads a SentencePiece model file (e.g. a local copy of the PaliGemma tokenizer)."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"tokenizer model {path!r} not found; copy the PaliGemma tokenizer from "
                f"{PALIGEMMA_TOKENIZER_URL} (e.g. `gsutil cp {PALIGEMMA_TOKENIZER_URL} {path}`), "
                "or use oxygen_jax.robots.tokenizer.train_demo_tokenizer() for tests and demos"
            )
        with open(path, "rb") as f:
            data = f.read()
        try:
            return cls.from_bytes(data)
        except ValueError as e:
            raise ValueError(
                f"{path!r} is not a SentencePiece model ({e}); the PaliGemma tokenizer is {PALIGEMMA_TOKENIZER_URL}"
            ) from e

    def to_bytes(self) -> bytes:
        """The serialized model, e.g. to write the demo tokenizer to a file."""
        return self._sp.serialized_model_proto()

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of `text`, optionally preceded by BOS. Never appends EOS.

        Text is plain text: SentencePiece never matches a control piece (pad, eos, bos, the model's other
        control symbols) in text, so "<s>", "</s>" or "<pad>" in a client's prompt are their characters
        (byte-fallback pieces at worst) and BOS/EOS come only from `add_bos` and the model. Pieces the model
        defines as user symbols (PaliGemma's "<loc0000>") are its ordinary vocabulary, matched as openpi's
        tokenizer matches them.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = self._sp.encode(text)
        return [self.bos_id, *ids] if add_bos else list(ids)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids`. Pad ids are dropped; control ids (BOS/EOS) decode to nothing; no early stop."""
        return self._sp.decode(self._checked_ids(ids))

    def _checked_ids(self, ids) -> list[int]:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"decode expects a 1-D sequence of integer ids, got shape {arr.shape} dtype {arr.dtype}")
        out = [int(i) for i in arr if i != self.pad_id]
        bad = [i for i in out if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the tokenizer vocabulary [0, {self.vocab_size})")
        return out

    def _is_byte(self, token_id: int) -> bool:
        return bool(self._sp.is_byte(token_id))

    def stream(self) -> "StreamDetokenizer":
        """An incremental detokenizer of this model (`StreamDetokenizer`)."""
        return StreamDetokenizer(self)


# -------------------------------------------------------------------------------------------------
# Trained tokenizers: the built-in demo one (tests, demos without the real model file) and one trained on
# a task's own texts
# -------------------------------------------------------------------------------------------------

MIN_TRAINED_VOCAB = 300  # a trained BPE needs its 256 byte pieces, the characters and the specials

_DEMO_TASKS = (
    "pick up the red cup", "pick the red cup", "put the bowl on the plate", "open the top drawer",
    "close the microwave", "put the cream cheese in the bowl", "turn on the stove", "stack the blocks",
    "push the plate to the front of the stove", "put both the alphabet soup and the tomato sauce in the basket",
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "move the mug to the left", "fold the towel", "uncap the pen", "grasp the handle", "place it in the box",
    "move the gripper above the object", "lower the arm", "release the object", "go to the sink",
)
_DEMO_SUBTASKS = (
    "reach the cup", "grasp the cup", "lift the cup", "move to the plate", "open the gripper", "close the gripper",
    "rotate the wrist", "pull the handle", "push the button", "done",
)


def _demo_corpus() -> list[str]:
    """A small deterministic robotics corpus covering every prompt format and the state digits."""
    lines = []
    for i, task in enumerate(_DEMO_TASKS):
        sub = _DEMO_SUBTASKS[i % len(_DEMO_SUBTASKS)]
        # State strings cycle through all bins -1..255 so every digit pattern is seen.
        bins = " ".join(str((i * 37 + 11 * k) % 257 - 1) for k in range(8))
        lines += [
            f"Task: {task}, State: {bins};\nAction: ",
            f"Task: {task}. Subtask: {sub}.;\nAction: ",
            f"Task: {task}. Subtask: ",
            f"{task[0].upper()}{task[1:]}\n",
            f"{task}.",
        ]
    lines += [" ".join(str(n) for n in range(k, k + 16)) for k in range(-1, 256, 16)]
    lines += ["Task: ", "Subtask: ", "State: ", ";\nAction: ", "Action: ", ", . ; : ! ? ' \" ( ) - _ / \n"]
    return lines


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < MIN_TRAINED_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_TRAINED_VOCAB} (256 byte pieces + characters + specials), "
                         f"got {vocab_size}")


def _train_bpe(lines: Sequence[str], vocab_size: int) -> bytes:
    """A BPE model proto trained in memory on `lines`, PaliGemma's id layout, deterministic."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        # Identity normalisation and kept whitespace: "…;\nAction: " must round-trip exactly.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,  # like Gemma: encode(a) + encode(b) == encode(a + b) at piece boundaries
        allow_whitespace_only_pieces=True,
        split_digits=True,
        byte_fallback=True,  # any UTF-8 text round-trips
        character_coverage=1.0,
        hard_vocab_limit=False,  # a small corpus may run out of merges first; let the trainer stop early
        num_threads=1,  # deterministic
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return buf.getvalue()


@functools.lru_cache(maxsize=8)
def _demo_model_proto(vocab_size: int) -> bytes:
    return _train_bpe(_demo_corpus(), vocab_size)


def train_demo_tokenizer(vocab_size: int = 400) -> Tokenizer:
    """Trains (in memory, offline, deterministically) a tiny BPE tokenizer with PaliGemma's id layout.

    pad 0, eos 1, bos 2, unk 3; identity normalisation, whitespace kept, byte fallback. The result has
    at most `vocab_size` pieces (fewer if the built-in corpus runs out of merges). Cached per size.
    """
    _check_vocab(vocab_size)
    return Tokenizer.from_bytes(_demo_model_proto(vocab_size))


def train_text_tokenizer(texts: Sequence[str], vocab_size: int = 640) -> Tokenizer:
    """A BPE tokenizer with PaliGemma's id layout (pad 0, eos 1, bos 2, unk 3), trained in memory on `texts`.

    The options of `train_demo_tokenizer` (identity normalisation, whitespace kept, split digits, byte
    fallback: any text round-trips), deterministic (one thread, unshuffled input). Trained on a task's own
    labels and instructions, its pieces are whole words, so labels are short token sequences.
    """
    _check_vocab(vocab_size)
    lines = [t for t in texts if t]
    if not lines:
        raise ValueError("train_text_tokenizer needs at least one non-empty text")
    return Tokenizer.from_bytes(_train_bpe(lines, vocab_size))


# -------------------------------------------------------------------------------------------------
# Prompts
# -------------------------------------------------------------------------------------------------

# 256 bins of width 1/128 on [-1, 1): left edges -1, -1 + 1/128, ..., 1 - 1/128.
_STATE_BIN_EDGES = np.linspace(-1.0, 1.0, 257)[:-1]


def discretize_state(state: np.ndarray) -> np.ndarray:
    """openpi's 256-bin state discretisation: bin index in [0, 255], or -1 below -1 (no clipping).

    Examples: -1.0 → 0, 0.0 → 128, 0.9921875 → 255, 5.0 → 255, -1.01 → -1.

    Args:
      state: float [..., Ds], the normalised, unpadded state.
    Returns:
      int64 [..., Ds].
    """
    x = np.asarray(state, dtype=np.float64)
    if np.isnan(x).any():
        raise ValueError("state contains NaN; cannot discretise it into the prompt")
    return np.digitize(x, _STATE_BIN_EDGES) - 1


def _check_task(task) -> str:
    if isinstance(task, bytes):
        task = task.decode("utf-8")
    if not isinstance(task, str):
        raise ValueError(f"prompt must be a str, got {type(task).__name__}")
    return task


def _clean_action_task(task: str) -> str:
    # openpi: strip, then '_' and '\n' become spaces; case is kept.
    return _check_task(task).strip().replace("_", " ").replace("\n", " ")


def format_action_prompt(task: str, state: np.ndarray | None) -> str:
    """The π0.5 prompt string (without BOS), or the cleaned task for the π0 format when `state` is None."""
    cleaned = _clean_action_task(task)
    if state is None:
        return cleaned
    bins = discretize_state(state)
    if bins.ndim != 1:
        raise ValueError(f"state must be one unpadded state vector [Ds], got shape {bins.shape}")
    return f"Task: {cleaned}, State: {' '.join(str(int(b)) for b in bins)};\nAction: "


def format_text_prompt(task: str) -> str:
    """OxyGen's text-generation prompt: "Pick the red cup!" → "Task: pick the red cup. Subtask: "."""
    text = _check_task(task).lower().strip().replace("_", " ").replace("\n", " ")
    if text and text[-1] in string.punctuation:
        text = text[:-1]
    return f"Task: {text}. Subtask: "


def _pad(ids: list[int], max_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if len(ids) > max_len:
        warnings.warn(
            f"prompt has {len(ids)} tokens, more than max_len={max_len}: truncated by {len(ids) - max_len} tokens",
            stacklevel=3,
        )
        ids = ids[:max_len]
    tokens = np.full((max_len,), pad_id, np.int32)
    tokens[: len(ids)] = ids
    mask = np.zeros((max_len,), bool)
    mask[: len(ids)] = True
    return tokens, mask


def tokenize_action_prompt(
    tok: Tokenizer, task: str, state: np.ndarray | None, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes an action prompt: π0.5 format with the discretised state, or π0 format if `state` is None.

    Args:
      tok: the tokenizer.
      task: the raw task instruction.
      state: float [Ds] normalised, unpadded state, or None (π0 format: `task` + "\\n", no state).
      max_len: T.
    Returns:
      (ids int32 [T] 0-padded, mask bool [T]); mask is True exactly on the kept prompt tokens.
    """
    if state is None:
        ids = tok.encode(_clean_action_task(task), add_bos=True) + tok.encode("\n")
    else:
        ids = tok.encode(format_action_prompt(task, state), add_bos=True)
    return _pad(ids, max_len, tok.pad_id)


def tokenize_text_prompt(tok: Tokenizer, task: str, max_len: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes OxyGen's text-generation prompt BOS "Task: {task}. Subtask: ", padded to `max_len`.

    Returns:
      (ids int32 [T] 0-padded, mask bool [T]).
    """
    return _pad(tok.encode(format_text_prompt(task), add_bos=True), max_len, tok.pad_id)


def encode_suffix_prompt(tok: Tokenizer, text: str) -> list[int]:
    """Ids (no BOS, no cleaning) of a per-request prompt written after a shared prefix, e.g. "Subtask: "."""
    return tok.encode(_check_task(text))


# -------------------------------------------------------------------------------------------------
# Streaming detokenization
# -------------------------------------------------------------------------------------------------


class StreamDetokenizer:
    """Turns a stream of generated ids into text pieces, never splitting a multi-byte character.

    Each `push` decodes a short window `ids[prefix:]` and returns the text beyond `ids[prefix:read]`
    (the already-emitted part of the window), so per-token cost does not grow with the stream. Text
    that still ends in a byte-fallback piece decoding to U+FFFD may be an incomplete UTF-8 sequence
    and is held back until a later id completes it (or a non-byte piece ends the run).

    Invariant: `"".join(push(...) for all pushes) + flush() == tok.decode(all_ids) == text`.

    Example (byte-fallback "€" = <0xE2><0x82><0xAC>): push([a]) → "a"; push([0xE2]) → "";
    push([0x82, 0xAC]) → "€".
    """

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._ids: list[int] = []  # all non-pad ids so far
        self._prefix = 0  # window start: a character boundary already emitted
        self._read = 0  # ids before this index have been emitted

    def push(self, ids: Sequence[int] | np.ndarray | int) -> str:
        """Appends ids; returns only the newly completed text (possibly "")."""
        self._ids += self._tok._checked_ids(np.atleast_1d(np.asarray(ids)))
        if len(self._ids) == self._read:
            return ""
        end = len(self._ids)
        new = self._window_text(end)
        if new.endswith("\ufffd") and self._tok._is_byte(self._ids[-1]):
            # Emit up to the start of the trailing run of byte pieces; keep the run pending.
            while end > self._read and self._tok._is_byte(self._ids[end - 1]):
                end -= 1
            if end == self._read:
                return ""
            new = self._window_text(end)
        return self._emit(new, end)

    def flush(self) -> str:
        """Returns any held-back text (an unfinished byte sequence decodes to U+FFFD)."""
        if len(self._ids) == self._read:
            return ""
        return self._emit(self._window_text(len(self._ids)), len(self._ids))

    @property
    def text(self) -> str:
        """The full text of every id pushed so far, including any held-back tail."""
        return self._tok._sp.decode(self._ids)

    def _window_text(self, end: int) -> str:
        done = self._tok._sp.decode(self._ids[self._prefix : self._read])
        full = self._tok._sp.decode(self._ids[self._prefix : end])
        return full[len(done) :]

    def _emit(self, new: str, end: int) -> str:
        self._prefix, self._read = self._read, end
        return new
