"""`python -m oxygen_jax.serve`'s automatic-request options and its start-up manners: a bad automatic-request
option is refused at start-up in one line, `--help` prints each default once, and the libraries' INFO
lines stay out of the server's log at the default level."""

from __future__ import annotations

import argparse
import logging
import re

import pytest

from oxygen_jax.serve import _parser, configure_logging, main, serve_config
from oxygen_jax.serving.auto_language import AutoLanguage


@pytest.mark.parametrize("argv, name", [
    (["--auto-language", "Memory: ", "--auto-temperature", "-1"], "--auto-temperature"),
    (["--auto-language", "Memory: ", "--auto-mode", "sometimes"], "--auto-mode"),
    (["--auto-language", "Memory: ", "--auto-max-tokens", "0"], "--auto-max-tokens"),
    (["--auto-language", "Memory: ", "--auto-max-tokens", "33"], "--auto-max-tokens"),  # above --max-new-tokens 32
    (["--auto-seed", "3"], "--auto-seed"),  # an automatic-request option without --auto-language
    (["--preset", "tiny", "--auto-language", "Memory: ", "--auto-adapter", "nope"], "--auto-adapter"),  # after loading
    (["--auto-language-ids", "12,x"], "--auto-language-ids"),
    (["--auto-language", "Memory: ", "--auto-language-ids", "12"], "--auto-language-ids"),  # text or ids, not both
    (["--preset", "tiny", "--auto-language-ids", "12,99999999"], "--auto-language-ids"),  # beyond the vocabulary
])
def test_a_bad_automatic_request_option_is_refused_at_start_up_in_one_line(argv, name, capsys):
    try:
        code = main([*argv, "--port", "0", "--compile-cache", "none", "--log-level", "ERROR"])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and name in err and len(err.strip().splitlines()) == 1, err


def test_the_automatic_request_options_reach_the_server_config():
    assert serve_config(_parser().parse_args([])).auto_language is None
    cfg = serve_config(_parser().parse_args(["--auto-language", "Memory: ", "--auto-max-tokens", "20", "--auto-seed",
                                             "7", "--auto-temperature", "0.1", "--auto-adapter", "memory",
                                             "--auto-mode", "keep"]))
    assert cfg.auto_language == AutoLanguage(prompt="Memory: ", max_tokens=20, seed=7, temperature=0.1,
                                             adapter="memory", mode="keep")


def test_help_prints_each_default_once_and_the_default_argparse_applies():
    parser = _parser()
    text = parser.format_help()
    assert "(default: None)" not in text
    formatter = parser._get_formatter()
    for action in parser._actions:
        shown = formatter._expand_help(action) if action.help else ""
        assert len(re.findall(r"\(default\b|\bdefault:", shown)) <= 1, action.option_strings
        d = action.default
        unset = d is None or d is False or d == argparse.SUPPRESS or d == []  # `0 in (None, False)` is True
        if not unset and not re.search(r"\(default|default:", action.help or ""):
            assert f"(default: {action.default})" in shown, action.option_strings  # the value argparse applies
    flat = " ".join(text.split())
    assert "(default: 1,2,4,8)" in flat and parser.parse_args([]).batch_sizes == (1, 2, 4, 8)
    assert "noise seed (default: 0)" in flat and "0 is greedy (default: 0.0)" in flat


def test_library_info_lines_are_quiet_at_the_default_level_and_shown_at_debug():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("INFO")
        assert all(logging.getLogger(n).getEffectiveLevel() == logging.WARNING for n in ("absl", "jax", "orbax"))
        assert logging.getLogger("oxygen_jax.serve").getEffectiveLevel() == logging.INFO
        configure_logging("DEBUG")
        assert logging.getLogger("absl").getEffectiveLevel() == logging.DEBUG
    finally:
        for n in ("absl", "jax", "orbax"):
            logging.getLogger(n).setLevel(logging.NOTSET)
        root.handlers[:] = handlers
        root.setLevel(level)


def test_token_id_auto_language_needs_no_tokenizer_and_is_checked_against_the_vocabulary():
    from oxygen_jax.serving.auto_language import prepare
    from test_serve import ScriptedEngine

    args = _parser().parse_args(["--auto-language-ids", "12,34,56", "--auto-max-tokens", "3"])
    auto = serve_config(args).auto_language
    assert auto == AutoLanguage(prompt_tokens=(12, 34, 56), max_tokens=3)
    engine = ScriptedEngine()
    engine.tokenizer = None  # a checkpoint without one
    assert prepare(auto, engine, max_prompt_chars=64).request.checked.prompt == (12, 34, 56)
    vocab = engine.limits.vocab_size
    with pytest.raises(ValueError, match=rf"^--auto-language-ids: .*token ids in \[0, {vocab}\)"):
        prepare(AutoLanguage(prompt_tokens=(12, vocab)), engine, max_prompt_chars=64)
    with pytest.raises(ValueError, match="exactly one"):
        AutoLanguage(prompt="Memory: ", prompt_tokens=(1,))


def test_the_automatic_request_values_are_the_one_request_checks_refused_by_option_in_one_line():
    from oxygen_jax.serving.auto_language import prepare
    from test_serve import ScriptedEngine

    engine = ScriptedEngine()
    cases = [(dict(max_tokens=0), "--auto-max-tokens: the automatic request's max_tokens must be an integer in [1, 8]"),
             (dict(temperature=float("nan")), "--auto-temperature: the automatic request's temperature must be 0"),
             (dict(temperature="hot"), "--auto-temperature: the automatic request's temperature must be a number"),
             (dict(seed=-1), "--auto-seed: the automatic request's seed must be None or an integer in [0, "),
             (dict(prompt=None, prompt_tokens=(1, "a")), "--auto-language-ids: the automatic request's prompt_tokens "
                                                          "must be a list of token ids")]
    for fields, start in cases:
        auto = AutoLanguage(**{"prompt": "Memory: ", **fields})  # values are not refused before the engine is known
        with pytest.raises(ValueError) as e:
            prepare(auto, engine, max_prompt_chars=64)
        assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)
    assert str(e.value).endswith("; use ids of this model's tokenizer")
