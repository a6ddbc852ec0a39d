"""Names from a model made safe to print: every control and bidi character escaped.

A node or tensor name is attacker-controlled text. Printed raw it can move the cursor, clear
the screen, set the terminal title (ESC, OSC), ring the bell, split one error into several
lines (CR/LF) or reorder what the reader sees (bidi overrides). `escape` spells each such
character as `\\xNN` / `\\uNNNN`, so a message stays one line and reads as what it is.
Standard library only: every layer (errors, reports, the CLI) may import it.
"""

from __future__ import annotations

import logging
import unicodedata

_BIDI = {0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}
_SEPARATORS = {0x2028, 0x2029}  # line/paragraph separators: some terminals break lines on them


def _unsafe(ch: str) -> bool:
    code = ord(ch)
    return code in _BIDI or code in _SEPARATORS or unicodedata.category(ch) == "Cc"


def escape(text: object) -> str:
    """`text` (str() of it) with every C0/C1 control, DEL, bidi control and line separator escaped."""
    text = str(text)
    if text.isprintable() and not any(ord(ch) in _BIDI for ch in text):
        return text  # the common case, one C-level scan
    out = []
    for ch in text:
        if _unsafe(ch):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def md_code(text: object) -> str:
    """`text` escaped, as a Markdown code span that no backtick in it can close early."""
    text = escape(text)
    run = longest = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


class EscapingFormatter(logging.Formatter):
    """A logging formatter whose message (arguments included) is escaped: one record, one line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)


class Progress:
    """One live line on a terminal for a long step: `stage n/N, rate/s, ETA`; silent when not a terminal.

    Use as a context manager: `with Progress("calibrate", total=len(prompts), unit="prompt") as p:
    ... p.advance()`. The line is redrawn at most every `interval` seconds and erased at the end,
    so a log or a pipe sees nothing extra; the caller prints its own summary.
    """

    def __init__(self, stage: str, total: int | None = None, unit: str = "", stream=None, interval: float = 0.25,
                 clock=None):
        import sys
        import time

        self._clock = clock or time.monotonic
        self.stage, self.total, self.unit = escape(stage), total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.interval = interval
        self.start = self._last = self._clock()

    @property
    def elapsed(self) -> float:
        return self._clock() - self.start

    def line(self) -> str:
        """The progress text as it would be drawn now."""
        elapsed = max(self.elapsed, 1e-9)
        rate = self.done / elapsed
        unit = f" {self.unit}s" if self.unit else ""
        parts = [f"mtkc: {self.stage} {self.done}" + (f"/{self.total}" if self.total else "") + unit]
        if self.done:
            parts.append(f"{rate:.2f}/s" if rate < 10 else f"{rate:.0f}/s")
            if self.total and self.done < self.total:
                parts.append(f"ETA {_clock_text((self.total - self.done) / rate)}")
        parts.append(_clock_text(elapsed))
        return ", ".join(parts)

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = self._clock()
        if self.live and (now - self._last >= self.interval or (self.total and self.done >= self.total)):
            self._last = now
            self.stream.write("\r\x1b[K" + self.line())
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.live = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clock_text(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds}s"
