"""The pure parts: straggler figures, chart primitives, the report's HTML, the sparkline, and
the run-directory reader's tolerance."""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from orchestrate.cli.live import Snapshot, loss_line, render, sparkline
from orchestrate.core.metricrecord import MetricRecord
from orchestrate.core.plan.outcome import Attempt
from orchestrate.core.plan.plan import Plan, make_plan
from orchestrate.core.spec.inventory import InventorySpec, resolve_inventory
from orchestrate.core.spec.job import JobSpec
from orchestrate.diagnosis.stall import Diagnosis
from orchestrate.report import scales, svg
from orchestrate.report.html import render_report
from orchestrate.report.rundata import RunData, effective_metrics, step_at
from orchestrate.report.runfiles import add_pace, load_run, read_jsonl, write_report
from orchestrate.report.straggler import MATERIAL_GAP_PCT, pace

pytestmark = pytest.mark.unit

SVG_NS = "{http://www.w3.org/2000/svg}"


def window(rank: int, *, data: float, forward: float = 0.002, backward: float,
           optimizer: float = 0.001, steps: int = 10, t: float = 100.0,
           first: int = 1) -> dict[str, Any]:
    """A timing window with per-step figures multiplied out over ``steps`` steps."""
    return {"t": t, "rank": rank, "epoch": 1, "first_step": first,
            "last_step": first + steps - 1, "steps": steps, "samples": steps * 32,
            "data_s": data * steps, "forward_s": forward * steps, "backward_s": backward * steps,
            "optimizer_s": optimizer * steps,
            "wall_s": (data + forward + backward + optimizer) * steps + 0.01, "clock": "host"}


# --- straggler -------------------------------------------------------------------------------


def test_slow_data_rank_is_the_straggler_and_the_others_show_its_gap_as_sync() -> None:
    # rank 2 waits 30 ms for data; ranks 0, 1, 3 wait ~30 ms in the all-reduce instead.
    windows = {
        0: [window(0, data=0.001, backward=0.040)],
        1: [window(1, data=0.001, backward=0.041)],
        2: [window(2, data=0.031, backward=0.010)],
        3: [window(3, data=0.002, backward=0.039)],
    }
    nodes = {0: "a100-1", 1: "a100-1", 2: "slowdisk", 3: "a100-2"}
    result = pace(windows, nodes)
    assert result.straggler is not None
    assert (result.straggler.rank, result.straggler.node) == (2, "slowdisk")
    by_rank = result.by_rank()
    own = {r: 0.002 + 0.001 + 0.010 + d for r, d in ((0, .001), (1, .001), (2, .031), (3, .002))}
    others = sorted(v for r, v in own.items() if r != 2)
    assert result.straggler.gap_pct == pytest.approx((own[2] - others[1]) / others[1] * 100)
    assert by_rank[2].sync_s == pytest.approx(0.0)
    assert by_rank[0].sync_s == pytest.approx(0.030)
    assert by_rank[3].compute_s == pytest.approx(0.002 + 0.010 + 0.001)
    for r in by_rank.values():
        assert r.data_s + r.compute_s + r.sync_s == pytest.approx(
            r.data_s + r.forward_s + r.backward_s + r.optimizer_s)
        assert r.steps == 10 and r.samples == 320


def test_small_gaps_name_no_straggler_but_keep_the_slowest() -> None:
    windows = {0: [window(0, data=0.0010, backward=0.0100)],
               1: [window(1, data=0.0015, backward=0.0095)]}
    result = pace(windows, {0: "n", 1: "n"})
    assert result.straggler is None
    assert result.slowest == 1
    assert 0 < result.by_rank()[1].gap_pct < MATERIAL_GAP_PCT


def test_one_rank_or_no_data_has_no_straggler() -> None:
    assert pace({}, {}).ranks == ()
    single = pace({0: [window(0, data=0.5, backward=0.1)]}, {0: "n"})
    assert single.straggler is None and single.by_rank()[0].gap_pct == 0.0
    empty_windows = pace({0: [], 1: [{"t": 1.0, "steps": 0}]}, {})
    assert empty_windows.ranks == ()


def test_recent_windows_show_a_straggler_that_appears_late() -> None:
    early = {r: [window(r, data=0.001, backward=0.01, t=100.0)] for r in (0, 1)}
    late = {0: [window(0, data=0.001, backward=0.05, t=200.0, first=11)],
            1: [window(1, data=0.041, backward=0.01, t=200.0, first=11)]}
    windows = {r: early[r] + late[r] for r in (0, 1)}
    recent = pace(windows, {}, last_s=30)
    assert recent.straggler is not None and recent.straggler.rank == 1
    assert recent.by_rank()[1].steps == 10
    assert pace(windows, {}).by_rank()[1].steps == 20


# --- sparkline and live view ---------------------------------------------------------------------


def test_sparkline_scales_low_to_high_and_buckets_long_series() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([3.0, 3.0, 3.0]) == "▄▄▄"
    assert sparkline([]) == "" and sparkline([float("nan")]) == ""
    long = sparkline([float(i) for i in range(1000)], width=20)
    assert len(long) == 20 and long[0] == "▁" and long[-1] == "█"
    line = loss_line([2.0, 1.0, 0.5])
    assert line == "loss █▃▁ 0.5 (first 2)"


def test_live_view_lists_every_rank_and_marks_the_straggler() -> None:
    from rich.console import Console

    windows = {0: [window(0, data=0.001, backward=0.04)],
               1: [window(1, data=0.031, backward=0.01)]}
    status = {"id": "j-1", "state": "RUNNING", "started_at": 50.0,
              "ranks": [{"rank": 0, "node": "a", "state": "RUNNING"},
                        {"rank": 1, "node": "b", "state": "RUNNING"},
                        {"rank": 2, "node": "c", "state": "RUNNING"}]}
    snap = Snapshot(status=status, pace=pace(windows, {0: "a", 1: "b"}), losses=[2.0, 1.0],
                    last_metrics=MetricRecord("step", epoch=1, step=10),
                    heartbeats={0: 95.0, 1: None},
                    now=100.0)
    console = Console(width=140, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(snap))
    text = console.export_text()
    assert "straggler: rank 1 (b)" in text
    assert re.search(r"^\s*0 +a .* 5s ago", text, flags=re.M), text
    assert re.search(r"^\s*2 +c +RUNNING +- ", text, flags=re.M), text
    assert "loss █▁ 1" in text and "step 10" in text and "running 50s" in text
    assert "batch" not in text, "no batch column without global_batch_size"

    console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(Snapshot(status=status, pace=pace(windows, {0: "a", 1: "b"}),
                                  shares=(48, 12, 4), now=100.0)))
    text = console.export_text()
    assert re.search(r"^\s*rank +node +state +batch ", text, flags=re.M), text
    assert re.search(r"^\s*0 +a +RUNNING +48 ", text, flags=re.M), text
    assert re.search(r"^\s*2 +c +RUNNING +4 +- ", text, flags=re.M), text


# --- chart primitives ----------------------------------------------------------------------------


def _parse(text: str) -> ElementTree.Element:
    return ElementTree.fromstring(text)


def test_line_chart_is_deterministic_well_formed_svg_with_markers() -> None:
    series = [svg.Series("loss", [(1, 2.0), (2, 1.0), (3, 0.5)]),
              svg.Series("val <&>", [(1, 2.5), (3, 0.7)], svg.PALETTE[1])]
    markers = [svg.Marker(2, "restart 2", "restart")]
    one = svg.line_chart(series, chart_id="c", title="t", x_label="step", y_label="loss",
                         markers=markers)
    assert one == svg.line_chart(series, chart_id="c", title="t", x_label="step",
                                 y_label="loss", markers=markers)
    root = _parse(one)
    groups = root.findall(f"{SVG_NS}g[@class='series']")
    assert [g.attrib["data-series"] for g in groups] == ["loss", "val <&>"]
    assert [len(g.findall(f"{SVG_NS}circle")) for g in groups] == [3, 2]
    marker = root.find(f"{SVG_NS}g[@class='marker restart']")
    assert marker is not None and float(marker.attrib["data-x"]) == 2.0
    # the marker sits where step 2's points are
    x_marker = float(marker.find(f"{SVG_NS}line").attrib["x1"])  # type: ignore[union-attr]
    x_point = float(groups[0].findall(f"{SVG_NS}circle")[1].attrib["cx"])
    assert x_marker == pytest.approx(x_point)


def test_log_x_axis_for_message_sizes_with_an_expected_band() -> None:
    sizes = [2.0**k for k in range(10, 29, 2)]
    points = [(s, min(s / 2**20, 9.0)) for s in sizes]
    chart = svg.line_chart([svg.Series("busbw gloo", points)], chart_id="bw", title="busbw",
                           x_label="size", y_label="GB/s", log_x=True, log_base=2,
                           x_format=svg.size_bytes,
                           band=svg.Band("expected", [(sizes[0], 6.0, 12.0),
                                                      (sizes[-1], 6.0, 12.0)]))
    root = _parse(chart)
    ticks = [t.text for t in root.findall(f"{SVG_NS}g[@class='x-ticks']/{SVG_NS}text")]
    assert ticks[0] == "1K" and "1M" in ticks and ticks[-1] == "256M"
    xs = [float(c.attrib["cx"]) for c in root.iter(f"{SVG_NS}circle")]
    gaps = [b - a for a, b in itertools.pairwise(xs)]
    assert max(gaps) - min(gaps) < 0.3  # equal ratios are equal distances
    assert root.find(f"{SVG_NS}polygon[@class='band']") is not None


def test_thin_keeps_spikes_of_long_series() -> None:
    points = [(float(i), 1.0) for i in range(10_000)]
    points[5_432] = (5_432.0, 50.0)
    kept = scales.thin(points, 300)
    assert len(kept) <= 310 and (5_432.0, 50.0) in kept and kept[-1] == points[-1]


def test_stacked_bars_highlight_and_heatmap_cells() -> None:
    bars = [svg.Bar("rank 0", (0.001, 0.01, 0.03), data={"rank": "0"}),
            svg.Bar("rank 1", (0.031, 0.01, 0.0), note="+250% straggler", highlight=True,
                    data={"rank": "1"})]
    root = _parse(svg.stacked_bars(bars, (("data", "#e69f00"), ("compute", "#0072b2"),
                                          ("sync", "#ccc")), chart_id="s", title="split",
                                   x_label="per step", value_format=svg.milliseconds))
    highlighted = root.findall(f"{SVG_NS}g[@class='bar highlight']")
    assert [g.attrib["data-rank"] for g in highlighted] == ["1"]
    widths = [float(r.attrib["width"]) for r in highlighted[0].findall(f"{SVG_NS}rect")
              if "data-part" in r.attrib]
    assert widths[0] / widths[1] == pytest.approx(3.1, rel=0.02)
    heat = _parse(svg.heatmap(["a", "b", "c"], ["a", "b", "c"],
                              [[None, 10.0, 9.0], [10.0, None, 1.0], [9.5, 1.1, None]],
                              chart_id="m", title="pairs"))
    cells = heat.findall(f"{SVG_NS}g[@class='cell']")
    assert len(cells) == 6 and len(heat.findall(f"{SVG_NS}rect[@class='cell empty']")) == 3
    slow = [c for c in cells if float(c.attrib["data-value"]) < 2]
    assert {(c.attrib["data-row"], c.attrib["data-column"]) for c in slow} == {("b", "c"),
                                                                             ("c", "b")}


def test_ticks_and_formats() -> None:
    assert scales.nice_ticks(0, 0.95) == [0.0, 0.2, 0.4, 0.6, 0.8]
    assert scales.nice_ticks(3, 3) == [3]
    assert scales.log_ticks(1, 1e6) == [1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6]
    assert svg.seconds(185) == "3m05s" and svg.seconds(7300) == "2h01m"
    assert svg.size_bytes(256 * 2**20) == "256M" and svg.milliseconds(0.0123) == "12.3ms"


# --- the report ---------------------------------------------------------------------------------


def _plan(world: int = 2) -> Plan:
    """A real plan (as plan.json holds it) of one node with ``world`` A100s, whose node env
    names the interface."""
    inventory = resolve_inventory(InventorySpec.model_validate({"name": "t", "nodes": [
        {"name": "a100", "address": "10.0.0.1",
         "gpus": [{"model": "A100-80GB", "memory_gb": 80, "count": world}]}]}))
    job = JobSpec.model_validate({"name": "j", "backend": "ssh", "command": ["python", "train.py"],
                                  "secret_env": ["WANDB_API_KEY"],
                                  "resources": {"nodes": 1, "gpus_per_node": world}})
    data = make_plan(job, inventory, job_id="j-1", run_dir="/r/j-1", workdir="/w").to_json()
    data["nodes"][0]["env"]["NCCL_SOCKET_IFNAME"] = "eno1"
    return Plan.from_json(data)


def _metrics(*records: dict[str, Any]) -> list[MetricRecord]:
    found = [MetricRecord.from_json(r) for r in records]
    assert None not in found
    return [r for r in found if r is not None]


def test_report_with_only_a_plan_is_complete_html_without_external_references() -> None:
    html = render_report(RunData(job_id="j-1", plan=_plan()))
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert "NCCL_SOCKET_IFNAME=eno1" in html and "WANDB_API_KEY" in html
    assert "no per-rank step timing" in html
    assert "<script" not in html and "src=" not in html


def test_report_marks_restarts_and_stalls_and_draws_the_doctor() -> None:
    metrics = _metrics(
        {"kind": "start", "step": 1, "time": 10.0, "resumed_from_step": None,
         "batch_shares": [48, 16]},
        {"kind": "epoch", "epoch": 1, "step": 10, "train_loss": 2.0, "val_loss": 2.1,
         "time": 20.0},
        {"kind": "step", "step": 12, "train_loss": 1.9, "time": 22.0},
        {"kind": "start", "step": 11, "time": 40.0, "resumed_from_step": 10},
        {"kind": "epoch", "epoch": 2, "step": 20, "train_loss": 1.0, "val_loss": 1.2,
         "time": 50.0, "peak_memory_gb": [1.25, 0.5]},
        {"kind": "checkpoint", "epoch": 2, "step": 20, "time": 51.0, "path": "x"},
    )
    doctor = {"verdict": "warn", "bandwidth": {
        "allreduce": [{"size_bytes": 2**k, "busbw_GBps": k / 3, "backend": "nccl"}
                      for k in range(10, 30, 2)],
        "expected": {"floor_GBps": 12.0},
        "pairs": {"nodes": ["a", "b"], "GBps": [[None, 11.0], [2.0, None]]}}}
    data = RunData(
        job_id="j-1", plan=_plan(),
        job={"id": "j-1", "state": "COMPLETED", "submitted_at": 0.0, "started_at": 2.0,
             "first_step_at": 10.0, "finished_at": 60.0},
        metrics=metrics,
        stalls=[Diagnosis("laggard", (1,), ("a100",), "rank 1 (node a100) has not reached "
                          "collective #42", 21.0)],
        attempts=[Attempt(1, 2.0, 30.0, "node failure"),
                  Attempt(2, 35.0, 60.0, "", resumed_from_step=10)],
        doctor=doctor,
    )
    html = render_report(data)
    charts = {e.attrib["id"]: e for e in map(ElementTree.fromstring,
                                            re.findall(r"<svg\b.*?</svg>", html, flags=re.S))}
    loss = charts["loss"]
    restart = loss.find(f"{SVG_NS}g[@class='marker restart']")
    stall = loss.find(f"{SVG_NS}g[@class='marker stall']")
    assert restart is not None and float(restart.attrib["data-x"]) == 10.0
    assert stall is not None and float(stall.attrib["data-x"]) == pytest.approx(11.0)
    # the step record of the attempt that died after step 10 is not drawn
    assert charts["loss"].find(f".//{SVG_NS}g[@data-series='train_loss (logged steps)']") is None
    phases = charts["phases"]
    assert len(phases.findall(f"{SVG_NS}g[@class='span attempt']")) == 2
    for kind in ("restart", "stall", "checkpoint", "first-step", "end", "submitted"):
        assert phases.find(f"{SVG_NS}g[@class='event {kind}']") is not None, kind
    assert "rank 1 (node a100) has not reached collective #42" in html
    assert "<th>batch shares</th><td>48, 16 (of 64)</td>" in html
    assert "<th>peak memory GB by rank</th><td>1.25, 0.5</td>" in html
    band = charts["busbw"].find(f"{SVG_NS}polygon[@class='band']")
    assert band is not None and "6-12 GB/s" in (band.findtext(f"{SVG_NS}title") or "")
    assert len(charts["pairs"].findall(f"{SVG_NS}g[@class='cell']")) == 2


def test_effective_metrics_and_step_at() -> None:
    records = _metrics(*({"kind": "step", "step": s, "time": float(s)} for s in (5, 10, 15)))
    records += _metrics({"kind": "start", "step": 11, "resumed_from_step": 10, "time": 20.0},
                        {"kind": "step", "step": 15, "time": 25.0})
    kept = effective_metrics(records)
    assert [(r.kind, r.step) for r in kept] == [("step", 5), ("step", 10), ("start", 11),
                                                ("step", 15)]
    assert step_at(kept, 7.5) == pytest.approx(7.5)
    assert step_at(kept, -1) == 5 and step_at([], 3.0) is None


# --- reading run directories ---------------------------------------------------------------------


def test_reader_tolerates_missing_files_and_a_line_being_written(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = load_run(run, now=5.0)
    assert data.job_id == "run" and data.metrics == [] and data.timing == {}
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "start", "step": 1}\n{"kind": "ep')
    (run / "timing").mkdir()
    (run / "timing" / "rank-0.jsonl").write_text(json.dumps(window(0, data=0.1, backward=0.1))
                                                 + "\n{")
    (run / "timing" / "rank-x.jsonl").write_text("junk")
    (run / "diag").mkdir()
    (run / "diag" / "diagnosis.json").write_text(json.dumps(
        {"kind": "frozen", "ranks": [3], "nodes": ["b"], "summary": "s", "at": 4.0}))
    (run / "attempts.json").write_text("[not json")
    assert read_jsonl(run / "metrics.jsonl") == [{"kind": "start", "step": 1}]
    data = load_run(run, {"id": "job-7", "state": "RUNNING", "ranks": []}, now=5.0)
    assert data.job_id == "job-7" and list(data.timing) == [0] and data.attempts == []
    assert [s.kind for s in data.stalls] == ["frozen"]
    path = write_report(run, {"id": "job-7", "state": "RUNNING", "ranks": []})
    assert path == run / "report.html" and "job-7" in path.read_text()
    status = add_pace({"ranks": [{"rank": 0, "node": "n"}, {"rank": 1, "node": "m"}]}, run)
    assert status["straggler"] is None
    assert status["ranks"][0]["timing"]["steps"] == 10 and status["ranks"][1]["timing"] is None


def test_the_reader_takes_the_typed_records_back(tmp_path: Path) -> None:
    """plan.json, diagnosis.json, the job record's attempts and metrics.jsonl come back as the
    records that wrote them; damaged entries are skipped, not half-read."""
    run = tmp_path / "run"
    (run / "diag").mkdir(parents=True)
    plan = _plan()
    (run / "plan.json").write_text(json.dumps(plan.to_json()))
    stall = Diagnosis("laggard", (1,), ("a100",), "rank 1 waits", 21.0, ("/r/x",))
    (run / "diag" / "diagnosis.json").write_text(json.dumps(
        {"diagnoses": [stall.to_json(), {"kind": "frozen", "summary": "no time"}]}))
    attempts = [Attempt(1, 2.0, 30.0, "node failure", ("h2",)), Attempt(2, 35.0)]
    lines = [MetricRecord("start", epoch=1, step=1, time=10.0, world_size=2),
             MetricRecord("epoch", epoch=1, step=16, train_loss=0.5, lr=1e-3, time=12.0,
                          peak_memory_gb=(1.25, 1.5)),
             MetricRecord("checkpoint", epoch=1, step=16, time=13.0, path="/c/16"),
             MetricRecord("end", outcome="completed", epoch=1, step=16, time=14.0)]
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r.to_json()) + "\n" for r in lines) + '{"step": 3}\n')
    job = {"id": "j-1", "attempts": [a.to_json() for a in attempts] + [{"n": 3}]}
    data = load_run(run, job, now=5.0)
    assert data.plan == plan and data.job_id == "j-1"
    assert data.stalls == [stall]
    assert data.attempts == attempts
    assert data.metrics == lines
    # each kind's line holds its own fields, as the trainer writes them
    assert list(lines[0].to_json()) == ["kind", "epoch", "step", "time", "world_size",
                                        "resumed_from_step"]
    assert lines[1].to_json()["peak_memory_gb"] == [1.25, 1.5]
    assert "path" in lines[2].to_json() and "train_loss" not in lines[2].to_json()


def test_a_metric_record_reads_what_it_can() -> None:
    record = MetricRecord.from_json({"kind": "epoch", "step": 4.0, "train_loss": "x",
                                     "val_loss": float("nan"), "lr": True, "epoch": 2})
    assert record == MetricRecord("epoch", epoch=2, step=4)
    assert MetricRecord.from_json({"step": 4}) is None and MetricRecord.from_json([1]) is None
    newer = MetricRecord("step", epoch=2, step=8, train_loss=0.25)
    merged = MetricRecord("epoch", epoch=1, step=4, val_accuracy=0.9).updated(newer)
    assert (merged.kind, merged.step, merged.train_loss, merged.val_accuracy) == (
        "step", 8, 0.25, None)  # a step record carries val_accuracy: null, as its line does


def test_a_timer_that_cannot_write_says_so_once_and_stops(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    from orchestrate.train.timing import StepTiming

    blocker = tmp_path / "file"
    blocker.write_text("")
    timer = StepTiming(blocker / "timing" / "rank-0.jsonl", 0, interval_s=0.0)
    for step in (1, 2, 3):
        timer.resume()
        timer.data_ready(32)
        timer.forward_done()
        timer.backward_done()
        timer.step_done(step, 1)
    timer.close()
    err = capsys.readouterr().err
    assert err.count("step timing off") == 1 and not timer.on


def test_timer_switch_and_windows(tmp_path: Path) -> None:
    from orchestrate.train.timing import StepTiming

    off = StepTiming.for_rank(tmp_path, 0, cuda=False, environ={"ORCHESTRATE_TIMING": "0"})
    assert not off.on
    timer = StepTiming.for_rank(tmp_path, 3, cuda=False,
                                environ={"ORCHESTRATE_TIMING_S": "1000"})
    for step in range(1, 6):
        timer.resume()
        timer.data_ready(8)
        timer.forward_done()
        timer.backward_done()
        timer.step_done(step, 1)
    assert not (tmp_path / "timing" / "rank-3.jsonl").exists()  # the window is still open
    timer.close()
    (record,) = read_jsonl(tmp_path / "timing" / "rank-3.jsonl")
    assert (record["first_step"], record["last_step"], record["steps"], record["samples"]) == (
        1, 5, 5, 40)
    assert record["rank"] == 3 and record["clock"] == "host"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_measured_shares_show_the_step_time_before_and_after() -> None:
    from orchestrate.report.balance import balance

    records = [
        MetricRecord("start", epoch=1, step=1, time=1.0, world_size=2, batch_shares=(512, 512)),
        MetricRecord("shares", epoch=1, step=8, time=2.0, batch_shares=(684, 340)),
        MetricRecord("epoch", epoch=1, step=16, time=3.0, batch_shares=(684, 340)),
    ]
    # rank 1 is slow: both ranks' steps last 0.2 s at equal shares, 0.14 s after (validation
    # and checkpoints in the windows' wall time are not steps)
    windows = {rank: [window(rank, data=0.0, backward=0.197, steps=8, first=1),
                      window(rank, data=0.0, backward=0.137, steps=8, first=9)]
               for rank in (0, 1)}
    for rank_windows in windows.values():
        rank_windows[1]["wall_s"] = 5.0
    split = balance(records, windows)
    assert split is not None and split.first == (512, 512) and split.now == (684, 340)
    assert split.changed_at == 8
    assert split.step_s_before == pytest.approx(0.2) and split.step_s_after == pytest.approx(0.14)
    assert split.line() == ("batch shares by rank: 684, 340 of 1024 since step 8 (512, 512 "
                            "before); step 200 ms before, 140 ms after")
    page = render_report(RunData(job_id="j", job={}, metrics=records, timing=windows))
    assert "684, 340 (of 1024)" in page and "200 ms / 140 ms" in page
    # Fixed shares: no change to tell of.
    fixed = balance(records[:1], windows)
    assert fixed is not None and fixed.line() == "batch shares by rank: 512, 512 of 1024"
    assert balance([MetricRecord("start", epoch=1, step=1)], windows) is None
