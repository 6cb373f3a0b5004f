"""Automatic language requests: the server opens one for the observations robots send, unasked.

OxyGen's server opens a memory request ("Memory: ") on every call (`new_each_call`); a robot then reads the
text as it grows from the per-frame updates of its replies (`serving.outbox`), with no change on its side:
an unmodified openpi client gets them. `ServeConfig.auto_language = AutoLanguage(prompt="Memory: ", ...)`
(`serve --auto-language PROMPT`) turns it on for every robot of a server; a checkpoint without a tokenizer
takes the prompt as token ids, `AutoLanguage(prompt_tokens=(12, 34, 56))` (`serve --auto-language-ids 12,34,56`),
each checked against the model's vocabulary at start-up.

What happens to a robot's automatic request that is still running when its next observation arrives is
`AutoLanguage.mode`:

| mode            | each observation                                                                    |
|-----------------|-------------------------------------------------------------------------------------|
| `new_each_call` | opens a new request; earlier ones keep running to their end (OxyGen's `new_each_call`) |
| `keep`          | opens one only when none of the robot's automatic requests is running               |
| `replace`       | cancels the running one (its result: failed, "replaced ...") and opens a new one     |

Automatic requests count toward the robot's `max_requests_per_robot` after the requests the robot sent
itself: when no room is left, that observation's automatic request is skipped (the reply's
"language.auto_skipped" says why) and the frame is served as usual. An automatic request is accepted like a
robot's own ("accepted" entry with "auto": true and tag `AutoLanguage.tag`) and answered like one
(per-frame "updates", then one "finished" or "failed" entry).

Everything about an automatic request is checked once, at start-up (`prepare`): a bad option is a
one-line ValueError before the server answers anyone, never a refusal of a robot's frame.
"""

from __future__ import annotations

import dataclasses

from oxygen_jax.serving import requests
from oxygen_jax.serving.records import LanguageRequest

MODES = ("new_each_call", "keep", "replace")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoLanguage:
    """The language request a server opens for each observation (CLI: `serve --auto-*`)."""

    prompt: str | None = None  # the request's prompt, e.g. "Memory: " (text, in the model's tokenizer)
    prompt_tokens: tuple[int, ...] | None = None  # or its token ids, for a model without a tokenizer (one of the two)
    max_tokens: int | None = None  # token budget; None: the engine's max_new_tokens (--max-new-tokens)
    temperature: float = 0.0  # 0 is greedy
    seed: int | None = None  # the sampling seed of every automatic request; None: each request's own id
    adapter: str = "base"  # a language adapter the server holds, by name
    mode: str = "new_each_call"  # what a new observation does to a running automatic request (module table)
    tag: str = "auto"  # the "tag" of its accepted / updates / finished entries

    def __post_init__(self):
        # What the request is made of; its values (ids, budget, temperature, seed, adapter) are the one request
        # check's (`RequestLimits.check`), against the engine's limits, in `prepare`.
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise ValueError("AutoLanguage takes a prompt (--auto-language PROMPT) or its token ids "
                             "(--auto-language-ids 12,34,56): exactly one of the two")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"AutoLanguage.prompt (--auto-language) must be text, got {type(self.prompt).__name__}")
        if self.prompt_tokens is not None and not isinstance(self.prompt_tokens, tuple):
            raise ValueError("AutoLanguage.prompt_tokens (--auto-language-ids) must be a tuple of token ids, got "
                             f"{type(self.prompt_tokens).__name__}")
        if self.mode not in MODES:
            raise ValueError(f"AutoLanguage.mode (--auto-mode) must be one of {', '.join(MODES)}, got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one observation does: the request to open (None: none), running ones to cancel first, and why
    none was opened when one should have been (None: not skipped)."""

    request: LanguageRequest | None
    replace: tuple[int, ...] = ()
    skipped: str | None = None


class AutoRequests:
    """An `AutoLanguage` checked against one engine, as the request each observation opens."""

    def __init__(self, auto: AutoLanguage, request: LanguageRequest):
        self.auto, self.request = auto, request

    def plan(self, running: list[int], live: int, asked: int, cap: int) -> Plan:
        """The automatic part of one observation of a robot.

        Args:
          running: the robot's live automatic requests (oldest first).
          live: all its live requests; asked: the requests this observation carries; cap: max_requests_per_robot.

        Example (cap 8, mode new_each_call): 3 live, 2 asked -> open one; 6 live, 2 asked -> skipped.
        """
        mode = self.auto.mode
        if mode == "keep" and running:
            return Plan(None)
        replace = tuple(running) if mode == "replace" else ()
        if live - len(replace) + asked + 1 > cap:
            return Plan(None, skipped=f"this robot has {live} language requests in flight and asked for {asked} "
                                      f"more (limit {cap}, max_requests_per_robot)")
        return Plan(self.request, replace)


def prepare(auto: AutoLanguage | None, engine, *, max_prompt_chars: int) -> AutoRequests | None:
    """`auto` checked against `engine` (its tokenizer, adapters, token and prompt capacity), tokenized once.

    Raises:
      ValueError: one line naming the option and the fix.
    """
    if auto is None:
        return None
    max_tokens = engine.limits.max_new_tokens if auto.max_tokens is None else auto.max_tokens
    prompt = {"prompt": auto.prompt} if auto.prompt_tokens is None else {"prompt_tokens": list(auto.prompt_tokens)}
    try:  # the one request check (`check_requests`: the engine's limits), its refusal named by the option
        (req,) = requests.parse_language_requests(
            [{**prompt, "max_tokens": max_tokens, "temperature": auto.temperature,
              "adapter": auto.adapter, **({} if auto.seed is None else {"seed": auto.seed})}],
            max_requests=1, default_max_tokens=max_tokens, max_prompt_chars=max_prompt_chars)
        (req,) = requests.check_requests([req], getattr(engine, "tokenizer", None), limits=engine.limits)
    except requests.BadRequest as err:
        what = str(err).replace("language_requests[0].", "the automatic request's ")
        raise ValueError(_refusal(auto, err.field, what)) from None
    return AutoRequests(auto, dataclasses.replace(req, tag=auto.tag, auto=True))


def _refusal(auto: AutoLanguage, field: str, what: str) -> str:
    """A start-up refusal of the automatic request: the option to change first, then the fix."""
    prompt_flag = "--auto-language" if auto.prompt_tokens is None else "--auto-language-ids"
    flag, fix = {
        "max_tokens": ("--auto-max-tokens", "lower it or raise --max-new-tokens"),
        "temperature": ("--auto-temperature", "0 is greedy"),
        "seed": ("--auto-seed", "pick one in range"),
        "adapter": ("--auto-adapter", "--adapter DIR adds one"),
        "tokenizer": ("--auto-language", "pass the checkpoint's tokenizer with --tokenizer, or give the prompt as "
                                         "token ids with --auto-language-ids"),
    }.get(field, (prompt_flag, "shorten the prompt or raise "
                               + ("--max-prompt-chars" if "characters" in what or "entries" in what else "--prompt-capacity")))
    if field == "prompt_tokens" and "token ids" in what:  # not ids of this model: out of its vocabulary, or no integers
        fix = "use ids of this model's tokenizer"
    return f"{flag}: {what}; {fix}"
