"""A model's text tokenizer from its checkpoint files, for language requests and their answers.

Two kinds, one interface (`encode(text) -> ids`, `decode(ids) -> text`, `vocab_size`, `stream()`):

| file | kind | who ships it |
|---|---|---|
| `tokenizer.model` | SentencePiece (`tokenizer.Tokenizer`, PaliGemma's id layout) | π0.5 (openpi, ours, the demo) |
| `tokenizer.json` | Hugging Face tokenizers (`QwenTextTokenizer`) | Qwen3 / Qwen3-VL / Qwen3.5, XR0, StarVLA |

Client text is text: `encode` never turns a special-token string in a request ("<|im_end|>") into its special
id (`native_prompts.QwenTokenizer.encode_text`). `stream()` gives an incremental detokenizer: each `push(ids)`
returns only newly completed text, and text that may end inside a multi-byte character (U+FFFD) waits for
the next ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from oxygen_jax.robots.native_prompts import QwenTokenizer
from oxygen_jax.robots.tokenizer import Tokenizer

FILES = ("tokenizer.model", "tokenizer.json")
"""The tokenizer files looked for beside a checkpoint, in this order."""


class QwenTextTokenizer(QwenTokenizer):
    """A `tokenizer.json` for text: plain-text `encode`, `decode` without special tokens, a streaming decoder."""

    unk_id = None  # ids the tokenizer does not know are dropped from text (the raw ids stay in the result)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return self.encode_text(text)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        known = [int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        """The id of a token string (e.g. tokenizer_config.json's eos_token), or None."""
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    def stream(self) -> _TextStream:
        return _TextStream(self)


class _TextStream:
    """Incremental `decode` for any tokenizer: text of all ids so far, minus what was already returned; a tail
    ending in U+FFFD (a character whose bytes are not all there yet) is held back until `flush`."""

    def __init__(self, tok):
        self._tok, self._ids, self._sent = tok, [], ""

    def push(self, ids) -> str:
        self._ids += [int(i) for i in np.atleast_1d(np.asarray(ids))]
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        return self._emit(text)

    def flush(self) -> str:
        return self._emit(self._tok.decode(self._ids))

    @property
    def text(self) -> str:
        """The full text of every id pushed so far, including any held-back tail."""
        return self._tok.decode(self._ids)

    def _emit(self, text: str) -> str:
        if not text.startswith(self._sent):  # a decoder that rewrites earlier text: send nothing twice
            return ""
        new, self._sent = text[len(self._sent):], text
        return new


def stream_detokenizer(tok):
    """The incremental detokenizer of `tok` (SentencePiece: `tokenizer.StreamDetokenizer`)."""
    return tok.stream()


def load_tokenizer(path: str | Path):
    """The tokenizer in `path`, by its file name: a SentencePiece `.model` or a Hugging Face `.json`."""
    path = Path(path)
    if path.suffix == ".json":
        return QwenTextTokenizer(path)
    return Tokenizer.from_file(path)


def find_tokenizer(*dirs: str | Path | None, names: Sequence[str] = FILES) -> Path | None:
    """The first of `names` in or beside (in the parent of) each directory, in order of `dirs`, then `names`."""
    for d in dirs:
        if d is None:
            continue
        d = Path(d).expanduser()
        for name in names:
            for cand in (d / name, d.parent / name):
                if cand.is_file():
                    return cand
    return None
