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
