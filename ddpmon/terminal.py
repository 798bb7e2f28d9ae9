"""Text from run dirs, job records and scrapes, made safe to print on an operator's terminal.

A run dir is written by the training job and a scrape answered by whoever holds the port, so a
parameter name, a message, a host name or an HTTP reason phrase can carry escape sequences:
OSC 52 writes the operator's clipboard, CSI clears the screen or moves the cursor, OSC 8 hides a
link behind innocent text, and a bidi override reorders what is shown. Every reader prints such
text through here:

- ``clean`` spells control characters out (``\\x1b``, ``\\u202e``): C0 except newline and tab,
  DEL, C1, and the bidi controls;
- ``shown`` is ``clean`` plus rich markup escaping, for text placed into a markup string
  (``[/x]`` in a name is printed, never parsed or raised as a ``MarkupError``);
- ``SafeConsole`` is a rich ``Console`` that cleans every piece of text it renders, whatever
  the call site forgot: the last line of defence, not a licence to skip ``shown``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.segment import Segment

_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


def _spell(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(text: Any) -> str:
    """``str(text)`` with every control character spelled out (newline and tab kept)."""
    return _CONTROL.sub(_spell, str(text))


def clean_line(text: Any) -> str:
    """``clean`` for a one-line field: newlines and tabs spelled out too."""
    return clean(text).replace("\n", "\\n").replace("\t", "\\t")


def shown(text: Any) -> str:
    """Untrusted text for a rich markup string: one line, cleaned, markup escaped."""
    return escape(clean_line(text))


class SafeConsole(Console):
    """A rich Console whose rendered text never carries a control character it did not put
    there itself (styles are applied after this, so colours still work)."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            segment if segment.control else Segment(clean(segment.text), segment.style)
            for segment in buffer
        )

    def render_str(self, text: str, **kwargs: Any):  # type: ignore[override]
        """A string that is not valid markup (a table cell holding ``[/x]``) is shown as
        written instead of raising ``MarkupError`` out of the reader."""
        from rich.errors import MarkupError  # rich only when a table is drawn: a light CLI start

        try:
            return super().render_str(text, **kwargs)
        except MarkupError:
            return super().render_str(text, **{**kwargs, "markup": False})
