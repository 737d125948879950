"""The output of a job on disk, on every backend: each rank's bytes once, in its own file, and the
merged view derived from them (orchestrate/hostside/outputlog.py); what a terminal is shown.

The writers here are the real ones (the supervisors' :class:`LogSink`, the Slurm merger's
:func:`cut` and :class:`Index`), the readers those of ``orchestrate logs`` and ``--follow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrate.cli.terminal import visible
from orchestrate.core.layout import MERGED_INDEX, rank_log
from orchestrate.hostside.outputlog import LINE_MAX, Index, Lines, Tail, View, cut, tail_lines
from orchestrate.run.logsink import LogSink
from tests.support.output import merged_bytes, merged_text

pytestmark = pytest.mark.unit


def test_the_merged_view_is_derived_from_the_rank_files_in_order(tmp_path: Path) -> None:
    sink = LogSink(tmp_path, {0: "n1", 1: "n2"})
    sink.line(0, b"zero a\n")
    sink.line(1, b"one a\n")
    sink.line(0, b"zero b\n")
    sink.note("a note\nwith a line break")
    sink.line(0, b"zero c, no newline")
    sink.close()
    assert merged_text(tmp_path).splitlines() == [
        "[n1:0] zero a", "[n2:1] one a", "[n1:0] zero b",
        "[orchestrate] a note with a line break", "[n1:0] zero c, no newline"]
    # One copy: each rank's bytes are in its file, exactly as written; the index only orders.
    assert rank_log(tmp_path, 0).read_bytes() == b"zero a\nzero b\nzero c, no newline"
    assert rank_log(tmp_path, 1).read_bytes() == b"one a\n"
    assert b"zero" not in (tmp_path / MERGED_INDEX).read_bytes()


def test_consecutive_output_of_one_rank_is_one_record(tmp_path: Path) -> None:
    sink = LogSink(tmp_path, {0: "n1"})
    for i in range(1000):
        sink.line(0, f"line {i}\n".encode())
    sink.flush()
    index = (tmp_path / MERGED_INDEX).read_text().splitlines()
    assert index == ["@ 0 logs/rank-0.log n1", f"0 0 {rank_log(tmp_path, 0).stat().st_size}"]
    sink.close()
    assert len(merged_text(tmp_path).splitlines()) == 1000


def test_a_restart_appends_and_may_move_a_rank(tmp_path: Path) -> None:
    first = LogSink(tmp_path, {0: "n1", 1: "n2"})
    first.line(0, b"attempt 1\n")
    first.close()
    second = LogSink(tmp_path, {0: "n3"})
    second.line(0, b"attempt 2\n")
    second.close()
    assert merged_text(tmp_path).splitlines() == ["[n1:0] attempt 1", "[n3:0] attempt 2"]
    assert rank_log(tmp_path, 0).read_bytes() == b"attempt 1\nattempt 2\n"


def test_a_line_without_an_end_is_shown_in_pieces_of_line_max(tmp_path: Path) -> None:
    long = b"x" * (3 * LINE_MAX + 5)
    sink = LogSink(tmp_path, {0: "n1"})
    for start in range(0, len(long), LINE_MAX):  # as the rank handles hand it over
        sink.line(0, long[start:start + LINE_MAX])
    sink.line(0, b"\nafter\n")
    sink.close()
    lines = merged_bytes(tmp_path).split(b"\n")
    assert [len(line) for line in lines[:4]] == [len(b"[n1:0] ") + LINE_MAX] * 3 + [7 + 5]
    assert lines[4:] == [b"[n1:0] after", b""]
    assert rank_log(tmp_path, 0).read_bytes() == long + b"\nafter\n"


def test_the_cap_keeps_the_first_bytes_and_says_so(tmp_path: Path) -> None:
    sink = LogSink(tmp_path, {0: "n1", 1: "n2"}, cap_bytes=25)
    for i in range(10):
        sink.line(0, f"chatty {i}\n".encode())
    sink.line(1, b"quiet\n")
    sink.close()
    assert rank_log(tmp_path, 0).read_bytes() == b"chatty 0\nchatty 1\nchatty 2\n"[:25]
    text = merged_text(tmp_path)
    assert "[orchestrate] rank 0 reached logs.max_mb_per_rank" in text
    assert "[orchestrate] rank 0: 65 byte(s) of output dropped past logs.max_mb_per_rank" in text
    assert "[n2:1] quiet" in text and "rank 1" not in text


def test_a_follower_sees_each_line_once_and_never_half_of_one(tmp_path: Path) -> None:
    sink = LogSink(tmp_path, {0: "n1", 1: "n2"})
    view = View(str(tmp_path / MERGED_INDEX))
    seen: list[bytes] = []
    sink.line(0, b"first\n")
    sink.flush()
    seen += view.lines()
    sink.line(1, b"second\n")
    sink.line(0, b"third\n")
    seen += view.lines()
    sink.close()
    seen += view.lines()
    seen += view.lines()
    assert seen == [b"[n1:0] first\n", b"[n2:1] second\n", b"[n1:0] third\n"]


def test_the_slurm_merger_cuts_parts_at_line_ends_and_line_max(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.log"
    path.write_bytes(b"whole\nbegun")
    assert cut(str(path), 0, path.stat().st_size) == len(b"whole\n")
    assert cut(str(path), 6, path.stat().st_size) == 6  # the begun line waits
    path.write_bytes(b"a\n" + b"y" * (2 * LINE_MAX + 3))
    assert cut(str(path), 0, path.stat().st_size) == 2 + 2 * LINE_MAX
    path.write_bytes(b"z" * LINE_MAX + b"\n")  # exactly LINE_MAX: still one line
    assert cut(str(path), 0, path.stat().st_size) == LINE_MAX + 1


def test_the_slurm_merger_waits_for_a_rank_that_has_not_written_yet(tmp_path: Path) -> None:
    """srun creates a rank's file when the rank first writes: until then the merger indexes the
    others (it died on the missing file, and the view lost every rank's output)."""
    from orchestrate.backends.slurm.monitor import _RankFiles

    (tmp_path / "logs").mkdir()
    paths = [str(tmp_path / "logs" / f"rank-{r}.log") for r in (0, 1)]
    files = _RankFiles(paths, [0, 0], 0)
    index = Index(str(tmp_path / MERGED_INDEX))
    index.declare(0, "logs/rank-0.log", "n1")
    index.declare(1, "logs/rank-1.log", "n2")
    assert cut(paths[1], 0, 0) == 0  # nothing to cut: the file is not read
    Path(paths[0]).write_bytes(b"ok-0\n")
    assert files.index_new(index, last=False)
    Path(paths[1]).write_bytes(b"ok-1\nbegun")
    assert files.index_new(index, last=False)
    assert files.index_new(index, last=True)
    index.close()
    assert merged_text(tmp_path).splitlines() == ["[n1:0] ok-0", "[n2:1] ok-1", "[n2:1] begun"]


def test_an_index_from_another_writer_is_read_the_same(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    rank0 = tmp_path / "logs" / "rank-0.log"
    rank0.write_bytes(b"one\ntwo\n")
    index = Index(str(tmp_path / MERGED_INDEX))
    index.declare(0, "logs/rank-0.log", "c1")
    index.part(0, 0, 4)
    index.note("between")
    index.part(0, 4, 4)
    index.close()
    (tmp_path / MERGED_INDEX).open("ab").write(b"12 not a part\n")
    assert merged_text(tmp_path).splitlines() == [
        "[c1:0] one", "[orchestrate] between", "[c1:0] two", "12 not a part"]


def test_lines_and_tail_hold_at_most_line_max(tmp_path: Path) -> None:
    lines = Lines()
    assert lines.feed(b"a\nb") == [b"a\n"]
    assert lines.feed(b"c" * LINE_MAX) == [b"b" + b"c" * (LINE_MAX - 1) + b"\n"]
    assert len(lines.pending) == 1
    assert lines.end() == [b"c\n"]
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"one\ntw")
    tail = Tail(str(log))
    assert list(tail.lines()) == [b"one\n"]
    with log.open("ab") as f:
        f.write(b"o\nthree")
    assert list(tail.lines()) == [b"two\n"]
    assert list(tail.lines(final=True)) == [b"three\n"]


def test_a_failures_last_lines_come_from_the_end_of_the_file_only(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"x" * (5 * LINE_MAX) + b"\nend 1\r\nend 2\n")
    assert tail_lines(str(log), 2) == ["end 1", "end 2"]
    assert tail_lines(str(tmp_path / "missing.log"), 2) == []


@pytest.mark.parametrize(("raw", "shown"), [
    (b"\x1b[2J\x1b[?1049hclear\n", "\\x1b[2J\\x1b[?1049hclear\n"),
    (b"\x1b]0;title\x07\n", "\\x1b]0;title\\x07\n"),
    (b"\x1b]52;c;aGk=\x1b\\\n", "\\x1b]52;c;aGk=\\x1b\\\n"),
    (b"\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\n", "\\x1b]8;;http://x\\x1b\\link\\x1b]8;;\\x1b\\\n"),
    (b"\r[orchestrate] forged\n", "\\x0d[orchestrate] forged\n"),
    ("\u009b31m c1 csi\n".encode(), "\\x9b31m c1 csi\n"),
    (b"tab\tand crlf\r\n", "tab\tand crlf\n"),
    (b"bell\x07 back\x08 del\x7f\n", "bell\\x07 back\\x08 del\\x7f\n"),
    (b"bad utf-8 \xff\n", "bad utf-8 \ufffd\n"),
])
def test_a_terminal_is_shown_every_control_character_escaped(raw: bytes, shown: str) -> None:
    assert visible(raw) == shown
