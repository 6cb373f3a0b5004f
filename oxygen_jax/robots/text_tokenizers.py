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

A tokenizer file is read before it is trusted (`load_tokenizer`): it must be a regular file (a device, FIFO or
link to one is refused, never taken for an absent file) of at most `MAX_TOKENIZER_BYTES`, and anything the
`tokenizers` or `sentencepiece` packages raise on it is one ValueError naming the file. `max_token_id(tok)` is
the largest id the tokenizer can produce (a `tokenizer.json` may number its tokens sparsely: an entry at id
1,000,245 in a two-token vocabulary); `check_vocabulary(tok, vocab_size, path)` refuses a tokenizer whose ids
reach past a model's embedding rows.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Sequence

import numpy as np

from oxygen_jax.robots.native_prompts import QwenTokenizer
from oxygen_jax.robots.tokenizer import Tokenizer

MAX_TOKENIZER_BYTES = 256 << 20  # a tokenizer.json or SentencePiece .model (Qwen's: 11 MB, PaliGemma's: 4 MB)


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

    @property
    def max_id(self) -> int:
        """The largest id the file assigns (its vocabulary and added tokens), e.g. 151,668 for Qwen3."""
        ids = list(self._tok.get_vocab(with_added_tokens=True).values())
        return max(ids) if ids else -1

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
    """The tokenizer in `path`, by its file name: a SentencePiece `.model` or a Hugging Face `.json`.

    Raises:
      FileNotFoundError: nothing at `path` (a dangling link included).
      ValueError: one line naming the file: not a regular file, unreadable, larger than `MAX_TOKENIZER_BYTES`,
        or not a tokenizer the package can load.
    """
    path = Path(path)
    _check_file(path)
    try:
        return QwenTextTokenizer(path) if path.suffix == ".json" else Tokenizer.from_file(path)
    except (FileNotFoundError, ValueError) as e:
        if str(path) in str(e):
            raise ValueError(str(e).splitlines()[0]) from None
        raise ValueError(f"{path}: not a readable tokenizer ({str(e).splitlines()[0][:200]})") from None
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception; report it in one line
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"{path}: not a readable tokenizer ({type(e).__name__}: {first}); pass the model's own "
                         "tokenizer.json or tokenizer.model") from None


def _check_file(path: Path) -> None:
    """A regular, readable file within `MAX_TOKENIZER_BYTES` (see `load_tokenizer`)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path}: no such tokenizer file")
    try:
        info = path.stat()
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e}); a link whose target is missing?") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file (a device, FIFO or directory, or a link to one); a tokenizer is "
                         "read from a regular file only")
    if info.st_size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"{path}: {info.st_size} bytes, larger than {MAX_TOKENIZER_BYTES}, the cap on a tokenizer file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path}: not readable (permission denied)")


def max_token_id(tok) -> int:
    """The largest id `tok` can produce: a `tokenizer.json`'s largest assigned id (`max_id`), a SentencePiece
    model's vocabulary size - 1 (its ids are dense)."""
    largest = getattr(tok, "max_id", None)
    return int(largest) if largest is not None else int(tok.vocab_size) - 1


def check_vocabulary(tok, vocab_size: int, path: str | Path) -> None:
    """Refuses (one-line ValueError) a tokenizer whose ids reach past a model's `vocab_size` embedding rows."""
    largest = max_token_id(tok)
    if largest >= vocab_size:
        raise ValueError(f"the tokenizer {path} produces ids up to {largest} but the model's vocabulary has "
                         f"{vocab_size} rows: pass the checkpoint's own tokenizer with --tokenizer")
