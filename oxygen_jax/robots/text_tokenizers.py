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
    """Incremental `decode` of a `tokenizer.json`: each push decodes a short window (the ids emitted by the
    previous push, as context, and the ids not yet emitted), so the per-token cost does not grow with the
    answer. A window ending in U+FFFD (a character whose bytes are not all there yet) is held back until a
    later id completes it, or `flush`; windows start where an emitted text ended, at a character boundary.

    Invariant: `"".join(push(...) for all pushes) + flush() == text == tok.decode(all ids)`.
    """

    def __init__(self, tok: QwenTextTokenizer):
        self._tok, self._ids = tok, []
        self._prefix = 0  # the window starts here (the previous push's first id)
        self._read = 0  # ids before this index are emitted

    def push(self, ids) -> str:
        self._ids += [int(i) for i in np.atleast_1d(np.asarray(ids))]
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        return self._emit(hold_incomplete=False)

    @property
    def text(self) -> str:
        """The full text of every id pushed so far, including any held-back tail."""
        return self._tok.decode(self._ids)

    def _emit(self, hold_incomplete: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        done = self._tok.decode(self._ids[self._prefix:self._read])
        window = self._tok.decode(self._ids[self._prefix:])
        if (hold_incomplete and window.endswith("\ufffd")) or not window.startswith(done):
            return ""  # an unfinished character, or a decoder that rewrote earlier text: wait for more ids
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(done):]


def load_tokenizer(path: str | Path):
    """The tokenizer in `path`, by its file name: a SentencePiece `.model` or a Hugging Face `.json`."""
    path = Path(path)
    if path.suffix == ".json":
        return QwenTextTokenizer(path)
    return Tokenizer.from_file(path)

