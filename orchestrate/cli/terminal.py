"""What a rank's output may do to the user's terminal: print text, nothing else.

A rank's bytes reach a terminal through ``submit --follow`` and ``orchestrate logs`` (``-f``
too). Written there as they are, they could clear the screen, switch to the alternate screen,
set the window's title (OSC 0), write the clipboard (OSC 52), plant links (OSC 8), or with a
carriage return print over their own ``[node:rank]`` prefix and pass for an ``[orchestrate]``
line. So on a terminal every C0 and C1 control character but newline and tab (ESC, and with it
every CSI and OSC sequence; CR, backspace, bell; DEL; U+0080-U+009F) is shown as a visible
escape, ``\\xNN``; a line's ``\\r\\n`` ending is its newline. Anywhere else (a pipe, a file) the
bytes go out as the rank wrote them, as the rank's file keeps them.
"""

from __future__ import annotations

import re
from typing import IO

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(line: bytes) -> str:
    """A line of output as a terminal may show it (text, every control escaped)."""
    text = line.decode("utf-8", errors="replace")
    if text.endswith("\r\n"):
        text = text[:-2] + "\n"
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def is_terminal(stream: IO[bytes] | IO[str]) -> bool:
    """Whether ``stream`` is a terminal (a stream without ``isatty`` is not)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class LineWriter:
    """Writes lines of output to a binary stream: raw, or escaped when it is a terminal."""

    def __init__(self, stream: IO[bytes], terminal: bool | None = None) -> None:
        self.stream = stream
        self.terminal = is_terminal(stream) if terminal is None else terminal

    def write(self, line: bytes) -> None:
        """One line (ending with its newline)."""
        self.stream.write(visible(line).encode("utf-8") if self.terminal else line)

    def flush(self) -> None:
        self.stream.flush()
