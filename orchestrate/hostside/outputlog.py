"""A job's output on disk: one copy of every rank's bytes, and the merged view derived from it.

Every rank's output goes, byte for byte as the rank printed it, to a file of its own
(``logs/rank-R.log``): the supervisor writes it on local and SSH jobs
(:mod:`orchestrate.run.logsink`), srun on Slurm. Nothing is stored twice. The merged view, every
rank's lines in the order they came, each behind its ``[node:rank]`` prefix, with orchestrate's
own notes among them, is derived from those files and one small index beside them
(``output.idx``), whose lines are:

- ``@ RANK FILE NODE``: rank RANK's output is in FILE (relative to the index's folder); its
  lines are shown as ``[NODE:RANK] ...`` from here on (a restart may move a rank elsewhere);
- ``RANK OFFSET LENGTH``: the next part of the view is bytes OFFSET to OFFSET+LENGTH of it;
- any other line is orchestrate's own (``[orchestrate] ...``) and is shown as it is.

**Lines.** A part starts a line. Inside it a line ends at its newline, or after
:data:`LINE_MAX` bytes, whichever comes first, and the part's last line ends with the part. So
no reader and no writer ever holds more than one such line, however long a rank's line without
a newline: a 200 MB line is shown as pieces of LINE_MAX bytes. Writers record a part only once
its bytes are in the file, and end a part at a line's end (or after LINE_MAX bytes of one), so
a follower never shows half a line as a whole one.

**Writers.** The parts of one job have one writer at a time (the supervisor; on Slurm the
merger in the batch script, which also works where appends from several hosts are not atomic:
NFS); notes may come from other processes too, each record being one ``write`` of a short line
to a file opened for appending. Readers need nothing but the index's path.

Standard library only, Python 3.8+: the Slurm batch job's ``monitor.py`` carries this module
to the compute node that writes the index (:mod:`orchestrate.hostside.shipping`).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

#: The longest line of the merged view: longer ones are shown in pieces of this size.
LINE_MAX = 64 * 1024
#: How much of a file a reader takes at once.
BLOCK = 1 << 16
#: How orchestrate's own lines begin.
NOTE_PREFIX = "[orchestrate] "


def note_record(text: str) -> bytes:
    """One note as an index line (a line break in ``text`` would begin another record)."""
    flat = " ".join(text.replace("\r", " ").split("\n"))
    return (NOTE_PREFIX + flat + "\n").encode("utf-8", "replace")


def append_note(index: str, text: str) -> None:
    """Append one note to the index at ``index`` (made if missing); errors are the caller's."""
    with open(index, "ab") as f:
        f.write(note_record(text))


class Index:
    """Appends records to an index; each record is one ``write`` of one line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def declare(self, rank: int, file: str, node: str) -> None:
        """Rank ``rank`` writes to ``file`` (relative to the index) and runs on ``node``."""
        self._write(f"@ {rank} {file} {node}\n".encode("utf-8", "replace"))

    def part(self, rank: int, offset: int, length: int) -> None:
        """The next part of the view: ``length`` bytes of the rank's file from ``offset``."""
        if length > 0:
            self._write(f"{rank} {offset} {length}\n".encode())

    def note(self, text: str) -> None:
        """A line of orchestrate's own."""
        self._write(note_record(text))

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        """Close the index (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Lines:
    """Cuts a stream of bytes into the view's lines: at a newline, or after LINE_MAX bytes."""

    def __init__(self) -> None:
        self.pending = b""  # a begun line, shorter than LINE_MAX

    def feed(self, block: bytes) -> list[bytes]:
        """The lines that ``block`` completes, each with its newline."""
        data = self.pending + block
        out: list[bytes] = []
        start = 0
        while True:
            # A line of LINE_MAX bytes may still end with its own newline.
            nl = data.find(b"\n", start, start + LINE_MAX + 1)
            if nl >= 0:
                out.append(data[start:nl + 1])
                start = nl + 1
            elif len(data) - start >= LINE_MAX:
                out.append(data[start:start + LINE_MAX] + b"\n")
                start += LINE_MAX
            else:
                break
        self.pending = data[start:]
        return out

    def end(self) -> list[bytes]:
        """The begun line, ended (the stream or the part is over)."""
        rest, self.pending = self.pending, b""
        return [rest + b"\n"] if rest else []


def cut(path: str, start: int, end: int) -> int:
    """Where a part of the file at ``path`` that begins at ``start`` (a line's start) may end,
    at most at ``end``: after its last whole line, or after the last LINE_MAX piece of a longer
    one. Reads in blocks: for a writer that indexes a file others write (the Slurm merger)."""
    line_start = start
    if end <= start:
        return start
    with open(path, "rb") as f:
        f.seek(start)
        position = start
        while position < end:
            block = f.read(min(BLOCK, end - position))
            if not block:
                break
            at = 0
            while True:
                nl = block.find(b"\n", at)
                upto = position + (nl if nl >= 0 else len(block))
                while upto - line_start > LINE_MAX:  # the open line is too long: cut it
                    line_start += LINE_MAX
                if nl < 0:
                    break
                line_start = position + nl + 1
                at = nl + 1
            position += len(block)
    return line_start


class View:
    """The merged view of an index, as far as it is written: :meth:`lines` yields what was
    added since the last call (a follower calls it again), holding at most a block of the
    index and one line of a rank's file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.folder = os.path.dirname(path)
        self.offset = 0
        self._partial = b""
        self._ranks: dict[int, tuple[str, bytes]] = {}

    def lines(self) -> Iterator[bytes]:
        """Every line of the view written since the last call, each ending in a newline."""
        while True:
            records = self._records()
            if records is None:
                return
            for record in records:
                yield from self._record(record)

    def _records(self) -> list[bytes] | None:
        """The next complete index lines (None once there are no more for now)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                block = f.read(BLOCK)
        except OSError:
            return None
        if not block:
            return None
        self.offset += len(block)
        data = self._partial + block
        *records, self._partial = data.split(b"\n")
        if len(self._partial) > LINE_MAX:  # not an index line: show it as it is
            records.append(self._partial)
            self._partial = b""
        return records

    def _record(self, record: bytes) -> Iterator[bytes]:
        words = record.split(b" ", 3)
        if record.startswith(b"@ ") and len(words) == 4 and words[1].isdigit():
            rank = int(words[1])
            node = words[3].decode("utf-8", "replace")
            self._ranks[rank] = (os.path.join(self.folder, words[2].decode("utf-8", "replace")),
                                 f"[{node}:{rank}] ".encode())
            return
        if len(words) == 3 and all(w.isdigit() for w in words):
            yield from self._part(int(words[0]), int(words[1]), int(words[2]))
            return
        if record:
            yield record + b"\n"

    def _part(self, rank: int, offset: int, length: int) -> Iterator[bytes]:
        path, prefix = self._ranks.get(
            rank, (os.path.join(self.folder, "logs", f"rank-{rank}.log"), f"[?:{rank}] ".encode()))
        lines = Lines()
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                while length > 0:
                    block = f.read(min(BLOCK, length))
                    if not block:
                        break
                    length -= len(block)
                    for line in lines.feed(block):
                        yield prefix + line
        except OSError:
            return
        for line in lines.end():
            yield prefix + line


class Tail:
    """Lines appended to one file since the last call (``logs --rank R -f``), at most LINE_MAX
    bytes each; a begun line waits for its end, unless it is LINE_MAX long already."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self._lines = Lines()

    def lines(self, final: bool = False) -> Iterator[bytes]:
        """The new lines; ``final``: the file is complete, so a begun line is ended too."""
        while True:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    block = f.read(BLOCK)
            except OSError:
                block = b""
            if not block:
                break
            self.offset += len(block)
            yield from self._lines.feed(block)
        if final:
            yield from self._lines.end()


def tail_lines(path: str, count: int) -> list[str]:
    """The last ``count`` lines of a file, read from its last block only ([] if it does not
    exist): what a failure's summary shows, never the whole of a huge log."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - BLOCK)
            f.seek(start)
            data = f.read(BLOCK)
    except OSError:
        return []
    pieces = data.split(b"\n")
    if start > 0 and len(pieces) > 1:
        pieces = pieces[1:]  # the first piece is the end of a line begun before the block
    if pieces and pieces[-1] == b"":
        pieces.pop()
    return [p.rstrip(b"\r").decode("utf-8", "replace") for p in pieces[-count:]]
