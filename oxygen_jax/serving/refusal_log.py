"""One log line per refused frame, rate-limited, so that refusals leave a trace at the default log level.

A client that keeps sending bad frames must not fill the log (nor take the event loop's time formatting
lines): at most `rate` lines per second after a burst of `burst`; a line written after a quiet spell says
how many refusals it left out.

    refusals = RefusalLog(rate=1.0, burst=10)
    refusals.note(stream_id=3, peer="10.0.0.7", reply="BadRequest: prompt has 5000 characters; ...")
    # WARNING oxygen_jax.serve: stream 3 (10.0.0.7) frame refused: BadRequest: prompt has 5000 characters; ...
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("oxygen_jax.serve")

MAX_LOGGED_CHARS = 200  # of the reply quoted in a line (replies are at most 1,000 characters)


class RefusalLog:
    """A token bucket of log lines for refused frames (one per server: every connection shares it)."""

    def __init__(self, rate: float = 1.0, burst: int = 10, clock=time.monotonic):
        if not rate > 0 or burst < 1:
            raise ValueError(f"RefusalLog needs rate > 0 lines per second and burst >= 1, got {rate}, {burst}")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens, self._last, self.left_out = float(burst), None, 0

    def note(self, stream_id: int, peer: str, reply: str) -> bool:
        """Counts one refused frame; logs it unless over the rate. Returns whether a line was written."""
        now = self._clock()
        if self._last is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens < 1.0:
            self.left_out += 1
            return False
        self._tokens -= 1.0
        text = reply if len(reply) <= MAX_LOGGED_CHARS else f"{reply[:MAX_LOGGED_CHARS - 1]}…"
        text = text.replace("\r", "\\r").replace("\n", "\\n")  # one line, whatever the frame carried
        more = f" ({self.left_out} more refused frames not logged)" if self.left_out else ""
        log.warning("stream %d (%s) frame refused: %s%s", stream_id, peer, text, more)
        self.left_out = 0
        return True
