"""Real two-rank runs: status names the straggler, the report draws the run's own numbers and
renders in a real headless Chromium."""

from __future__ import annotations

import re
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from tests.support.reportruns import EPOCHS, STEPS_PER_EPOCH, Run, Runs, chromium

pytestmark = [pytest.mark.process, pytest.mark.torch]

SVG_NS = "{http://www.w3.org/2000/svg}"


def _windows(run: Run, rank: int) -> list[dict[str, Any]]:
    import json

    path = run.run_dir / "timing" / f"rank-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _charts(html: str) -> dict[str, ElementTree.Element]:
    """Every inline SVG of the page, parsed as XML (so each must be well-formed), by id."""
    charts = {}
    for text in re.findall(r"<svg\b.*?</svg>", html, flags=re.S):
        element = ElementTree.fromstring(text)
        charts[element.attrib["id"]] = element
    return charts


def _report(cli_run: Any, run: Run) -> str:
    out = cli_run("report", run.job_id, check=True).stdout.strip()
    assert Path(out) == run.run_dir / "report.html"
    return Path(out).read_text()


@pytest.mark.timeout(400)
def test_every_rank_times_every_step_once(pace_runs: Runs) -> None:
    steps = EPOCHS * STEPS_PER_EPOCH
    for run in (pace_runs.slow, pace_runs.even):
        for rank in (0, 1):
            windows = _windows(run, rank)
            # The slow run lasts several 0.5 s windows; the even one may fit in one on a quiet
            # machine. Either way the windows tile the steps.
            assert len(windows) >= (2 if run is pace_runs.slow else 1), windows
            assert [w["first_step"] for w in windows] == [1] + [
                w["last_step"] + 1 for w in windows[:-1]]
            assert windows[-1]["last_step"] == steps
            assert sum(w["steps"] for w in windows) == steps
            assert sum(w["samples"] for w in windows) == steps * 32
            for w in windows:
                parts = w["data_s"] + w["forward_s"] + w["backward_s"] + w["optimizer_s"]
                assert 0 < parts <= w["wall_s"] + 1e-3
                assert w["clock"] == "host" and w["rank"] == rank


@pytest.mark.timing
@pytest.mark.timeout(400)
def test_status_names_the_slow_rank_as_straggler(pace_runs: Runs) -> None:
    status = pace_runs.slow.status
    assert status["state"] == "COMPLETED"
    straggler = status["straggler"]
    assert straggler is not None, status
    assert straggler["rank"] == 1 and straggler["node"] == "localhost"
    assert straggler["gap_pct"] >= 10
    ranks = {r["rank"]: r["timing"] for r in status["ranks"]}
    # rank 1 waits ~32 ms per step for its data; rank 0 waits as long in the all-reduce.
    assert ranks[1]["data_s"] > 0.025 > ranks[0]["data_s"]
    assert ranks[0]["sync_s"] > 0.02 and ranks[1]["sync_s"] < ranks[0]["sync_s"] / 4
    assert ranks[1]["gap_pct"] == pytest.approx(straggler["gap_pct"], abs=0.1)
    for figures in ranks.values():
        assert figures["steps"] == EPOCHS * STEPS_PER_EPOCH
        total = figures["data_s"] + figures["compute_s"] + figures["sync_s"]
        assert total == pytest.approx(figures["data_s"] + figures["forward_s"]
                                      + figures["backward_s"] + figures["optimizer_s"], rel=1e-3)
    text = pace_runs.cli.run("status", pace_runs.slow.job_id, check=True).stdout
    assert "straggler: rank 1 (localhost)" in text
    loss_line = next(line for line in text.splitlines() if line.startswith("loss "))
    assert re.search("[▁▂▃▄▅▆▇█]{5,}", loss_line), loss_line


@pytest.mark.timing
@pytest.mark.timeout(400)
def test_status_names_no_straggler_without_the_sleep(pace_runs: Runs) -> None:
    status = pace_runs.even.status
    gaps = [r["timing"]["gap_pct"] for r in status["ranks"]]
    assert status["straggler"] is None or status["straggler"]["gap_pct"] < 10, status
    assert max(gaps) < 10, gaps
    text = pace_runs.cli.run("status", pace_runs.even.job_id, check=True).stdout
    assert "no straggler" in text and "straggler: rank" not in text


@pytest.mark.timeout(400)
def test_report_draws_the_runs_own_numbers(pace_runs: Runs) -> None:
    run = pace_runs.slow
    html = _report(pace_runs.cli.run, run)
    # self-contained: nothing fetched from anywhere
    assert "<script" not in html and "<link" not in html and "src=" not in html
    assert set(re.findall(r"https?://[^\s\"']+", html)) <= {"http://www.w3.org/2000/svg"}
    charts = _charts(html)
    assert {"loss", "accuracy", "split", "pace-over-time", "phases"} <= set(charts)

    epochs = [m for m in run.metrics() if m["kind"] == "epoch"]
    assert len(epochs) == EPOCHS
    val = charts["loss"].find(f".//{SVG_NS}g[@data-series='val_loss']")
    assert val is not None
    dots = val.findall(f"{SVG_NS}circle")
    assert int(val.attrib["data-points"]) == len(dots) == len(epochs)
    # higher loss is drawn higher (smaller y), in the order of the run's epochs
    ys = [float(d.attrib["cy"]) for d in dots]
    losses = [e["val_loss"] for e in epochs]
    assert sorted(range(len(ys)), key=lambda i: ys[i]) == sorted(
        range(len(losses)), key=lambda i: -losses[i])
    assert all(f"{e['val_loss']:.3g}" in (d.findtext(f"{SVG_NS}title") or "")
               for e, d in zip(epochs, dots, strict=True))
    accuracy = charts["accuracy"].find(f".//{SVG_NS}g[@data-series='val_accuracy']")
    assert accuracy is not None and int(accuracy.attrib["data-points"]) == len(epochs)

    bars = charts["split"].findall(f"{SVG_NS}g")
    highlighted = [b for b in bars if "highlight" in b.attrib.get("class", "").split()]
    assert [b.attrib["data-rank"] for b in highlighted] == ["1"]
    status_gap = run.status["straggler"]["gap_pct"]
    assert float(highlighted[0].attrib["data-gap"]) == pytest.approx(status_gap, abs=0.1)
    note = highlighted[0].find(f"{SVG_NS}text[@class='note']")
    assert note is not None and note.text is not None
    shown = re.fullmatch(r"\+(\d+)% straggler", note.text)
    assert shown is not None and abs(int(shown.group(1)) - status_gap) <= 0.6, note.text
    timing = {r["rank"]: r["timing"] for r in run.status["ranks"]}
    for bar in bars:
        if "data-rank" not in bar.attrib:
            continue
        widths = {r.attrib["data-part"]: float(r.attrib["width"])
                  for r in bar.findall(f"{SVG_NS}rect") if "data-part" in r.attrib}
        mine = timing[int(bar.attrib["data-rank"])]
        total = mine["data_s"] + mine["compute_s"] + mine["sync_s"]
        drawn = sum(widths.values())
        for part, key in (("data", "data_s"), ("compute", "compute_s"), ("sync wait", "sync_s")):
            assert widths[part] / drawn == pytest.approx(mine[key] / total, abs=0.01)

    over_time = charts["pace-over-time"]
    for rank in (0, 1):
        line = over_time.find(f".//{SVG_NS}g[@data-rank='{rank}']")
        assert line is not None
        assert int(line.attrib["data-points"]) == len(_windows(run, rank))
    assert 'id="straggler" data-rank="1"' in html

    checkpoints = [m for m in run.metrics() if m["kind"] == "checkpoint"]
    assert len(checkpoints) >= EPOCHS
    marks = charts["phases"].findall(f".//{SVG_NS}g[@class='event checkpoint']")
    assert len(marks) == len(checkpoints)
    assert charts["phases"].find(f".//{SVG_NS}g[@class='event first-step']") is not None


@pytest.mark.timeout(400)
def test_report_without_straggler_highlights_no_rank(pace_runs: Runs) -> None:
    html = _report(pace_runs.cli.run, pace_runs.even)
    charts = _charts(html)
    bars = charts["split"].findall(f"{SVG_NS}g")
    assert [b for b in bars if "highlight" in b.attrib.get("class", "")] == []
    assert "no straggler" in html and 'id="straggler"' not in html


@pytest.mark.timeout(400)
def test_report_renders_in_headless_chromium(pace_runs: Runs, tmp_path: Path) -> None:
    browser = chromium()
    run = pace_runs.slow
    page = Path(pace_runs.cli.run("report", run.job_id, "-o", str(tmp_path / "r.html"),
                                  check=True).stdout.strip())
    assert page == tmp_path / "r.html"
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") >= 5
    assert "parsererror" not in dom.stdout and "This page contains the following errors" \
        not in dom.stdout
    assert "straggler: rank 1" in dom.stdout
    shot = tmp_path / "report.png"
    done = subprocess.run([*flags, "--window-size=1000,3200", f"--screenshot={shot}",
                           page.as_uri()], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    width, height, pixels = _decode_png(shot.read_bytes())
    assert (width, height) == (1000, 3200)
    colours = {pixels[i: i + 3] for i in range(0, len(pixels), 3)}
    assert len(colours) > 200  # text, charts and colours, not a blank or error page
    # the straggler's outline, label and line are drawn in the highlight red (#d62728)
    assert bytes((0xD6, 0x27, 0x28)) in colours


def _decode_png(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and RGB bytes of an 8-bit RGB/RGBA PNG (what Chromium writes); filters
    None/Sub/Up with numpy, Average/Paeth (a few rows) pixel by pixel."""
    import numpy as np

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, idat = 8, b""
    width = height = colour_type = 0
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset: offset + 4])
        kind = data[offset + 4: offset + 8]
        body = data[offset + 8: offset + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour_type in (2, 6)
        elif kind == b"IDAT":
            idat += body
        offset += 12 + length
    channels = 4 if colour_type == 6 else 3
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, stride + 1)
    image = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.int64)
    for y in range(height):
        kind, line = int(raw[y, 0]), raw[y, 1:].astype(np.int64)
        if kind == 1:
            line = np.cumsum(line.reshape(width, channels), axis=0).reshape(stride) & 0xFF
        elif kind == 2:
            line = (line + previous) & 0xFF
        elif kind in (3, 4):
            out = [0] * stride
            up = previous.tolist()
            values = line.tolist()
            for i in range(stride):
                left = out[i - channels] if i >= channels else 0
                corner = up[i - channels] if i >= channels else 0
                if kind == 3:
                    pred = (left + up[i]) // 2
                else:
                    p = left + up[i] - corner
                    pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - corner)
                    pred = left if pa <= pb and pa <= pc else up[i] if pb <= pc else corner
                out[i] = (values[i] + pred) & 0xFF
            line = np.array(out, dtype=np.int64)
        image[y] = line
        previous = line
    rgb = image.reshape(height, width, channels)[:, :, :3]
    return width, height, rgb.tobytes()
