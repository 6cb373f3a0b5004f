"""A checkpoint's end-of-text ids: where a language request stops by default.

Read in this order, the first that names any id winning (Hugging Face's own precedence for generation):

1. `generation_config.json` `eos_token_id` (an int, or a list: Qwen3-VL-Instruct stops at `<|im_end|>` and
   `<|endoftext|>`);
2. `config.json` `eos_token_id`, at its top level or in `text_config` (also inside an XR0 `vlm_config`);
3. `tokenizer_config.json` `eos_token` (a string or {"content": ...}), looked up in the tokenizer.

Each file is looked for in the given directories in order (a StarVLA checkpoint: its own folder, then the base
VLM's). None found: () (requests then decode to their budget unless they name stop ids; the commands say so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from oxygen_jax.ckpts import limits


def _read(path: Path) -> Mapping | None:
    """The JSON object in `path` (None when there is no such file or it holds no object); a file that is not
    a small regular JSON file is a one-line ValueError (`limits.read_json`)."""
    if not path.exists() and not path.is_symlink():
        return None
    value = limits.read_json(path)
    return value if isinstance(value, Mapping) else None


def _ids(value, where: str, vocab_size: int) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise ValueError(f"{where} must be a token id or a list of them, got {value!r:.80}")
    bad = [i for i in items if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{where} holds {bad[0]}, outside the model's vocabulary [0, {vocab_size})")
    return tuple(sorted(set(items)))


def _config_eos(config: Mapping):
    for where in (config, config.get("text_config"), config.get("vlm_config"),
                  (config.get("vlm_config") or {}).get("text_config") if isinstance(config.get("vlm_config"), Mapping) else None):
        if isinstance(where, Mapping) and where.get("eos_token_id") is not None:
            return where["eos_token_id"]
    return None


def read_stop_ids(dirs: Sequence[str | Path | None], vocab_size: int, tokenizer=None) -> tuple[int, ...]:
    """The stop ids of the checkpoint in `dirs` (see the module docstring); `tokenizer` resolves an `eos_token`
    string (`text_tokenizers.QwenTextTokenizer`). One-line ValueError for a malformed entry."""
    folders = [Path(d) for d in dirs if d is not None]
    for d in folders:
        gen = _read(d / "generation_config.json")
        if gen is not None and gen.get("eos_token_id") is not None:
            return _ids(gen["eos_token_id"], f"{d / 'generation_config.json'} eos_token_id", vocab_size)
    for d in folders:
        for name in ("config.json", "vlm_config.json"):
            cfg = _read(d / name)
            if cfg is not None and (eos := _config_eos(cfg)) is not None:
                return _ids(eos, f"{d / name} eos_token_id", vocab_size)
    if tokenizer is not None and hasattr(tokenizer, "token_id"):
        for d in folders:
            tc = _read(d / "tokenizer_config.json")
            eos = None if tc is None else tc.get("eos_token")
            eos = eos.get("content") if isinstance(eos, Mapping) else eos
            if isinstance(eos, str) and (i := tokenizer.token_id(eos)) is not None:
                return _ids(i, f"{d / 'tokenizer_config.json'} eos_token {eos!r}", vocab_size)
    return ()
