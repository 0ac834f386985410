"""forkserve.statusview.render: the ``forkserve status`` table, from hand-made snapshots.

A snapshot is what the control socket's ``status`` and the status server's ``/status`` answer.
The table is a header line for the arbiter, a totals line, a blank line, a column header and
one row per worker. Cells never contain spaces, so a row splits on whitespace; column names
("IN FLIGHT") are separated by two spaces or more.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from forkserve.statusview import render

COLUMNS = ["PID", "WORKER", "GEN", "STATE", "AGE", "REQUESTS", "IN FLIGHT", "CONNS", "BG", "RSS",
           "HEARTBEAT"]
LEFT = {"PID", "WORKER", "GEN", "STATE"}  # text-like columns; the numbers are right-aligned


def worker(pid: int, worker_id: int, **fields: Any) -> dict[str, Any]:
    """A worker as the arbiter reports it; ``fields`` override or (with None) remove keys."""
    w: dict[str, Any] = {
        "pid": pid, "worker_id": worker_id, "generation": 1, "state": "running", "age": 12.5,
        "requests_served": 3, "active_connections": 0, "in_flight_requests": 0,
        "background_tasks": 0, "booted": True, "rss_bytes": 20 * 1024 * 1024,
        "seconds_since_heartbeat": 0.25,
    }
    w.update(fields)
    return {k: v for k, v in w.items() if v is not None}


def snapshot(workers: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    snap: dict[str, Any] = {
        "ok": True, "state": "running", "ready": True, "generation": 1, "pid": 4242,
        "version": "0.1.0", "worker_class": "sync", "started": 1.7e9, "uptime": 75.0,
        "paused": False, "active_connections": 0, "in_flight_requests": 0,
        "background_tasks": 0, "workers": workers,
    }
    snap.update(fields)
    return {k: v for k, v in snap.items() if v is not None}


def spans(line: str, pattern: str) -> list[tuple[int, int, str]]:
    return [(m.start(), m.end(), m.group()) for m in re.finditer(pattern, line)]


def table(text: str) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """(the lines above the column header, the column header line, the rows as dicts)."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("PID "))
    names = [name for _, _, name in spans(lines[at], r"\S+(?: \S+)*")]
    assert names == COLUMNS, lines[at]
    rows = []
    for line in lines[at + 1:]:
        cells = line.split()
        assert len(cells) == len(names), f"row {line!r} does not have {len(names)} cells"
        rows.append(dict(zip(names, cells)))
    return lines[:at], lines[at], rows


def assert_aligned(text: str) -> None:
    """Every cell of a left-aligned column starts where its name starts; every cell of a
    right-aligned column ends where its name ends."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("PID "))
    header = spans(lines[at], r"\S+(?: \S+)*")
    for line in lines[at + 1:]:
        cells = spans(line, r"\S+")
        assert len(cells) == len(header), line
        for (h_start, h_end, name), (c_start, c_end, cell) in zip(header, cells):
            if name in LEFT:
                assert c_start == h_start, f"{name} cell {cell!r} starts at {c_start}, not {h_start}:\n{text}"
            else:
                assert c_end == h_end, f"{name} cell {cell!r} ends at {c_end}, not {h_end}:\n{text}"


# -- the arbiter's lines ------------------------------------------------------------------------

def test_header_and_totals_lines() -> None:
    text = render(snapshot([worker(101, 1), worker(102, 2)], generation=3, uptime=3725.0,
                           worker_class="thread", in_flight_requests=4, active_connections=5,
                           background_tasks=6))
    lines = text.splitlines()
    assert lines[0] == "forkserve 0.1.0  pid 4242  running (ready)  generation 3  up 1h02m  thread workers 2"
    assert lines[1] == "in flight 4  connections 5  background 6"
    assert lines[2] == ""
    assert lines[3].startswith("PID ")
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_not_ready_while_draining() -> None:
    first = render(snapshot([worker(101, 1, state="stopping")], state="draining",
                            ready=False)).splitlines()[0]
    assert "  draining (not ready)  " in first


def test_paused_marker() -> None:
    paused = render(snapshot([worker(101, 1)], paused=True, ready=False)).splitlines()
    assert paused[1] == "in flight 0  connections 0  background 0  PAUSED"
    running = render(snapshot([worker(101, 1)], paused=False))
    assert "PAUSED" not in running
    assert running.splitlines()[1] == "in flight 0  connections 0  background 0"


# -- the workers' rows --------------------------------------------------------------------------

def test_one_row_per_worker_in_the_snapshots_order() -> None:
    workers = [worker(301, 1), worker(302, 2, generation=2), worker(303, 3, state="booting")]
    _, _, rows = table(render(snapshot(workers)))
    assert [(r["PID"], r["WORKER"], r["GEN"], r["STATE"]) for r in rows] == [
        ("301", "1", "1", "running"), ("302", "2", "2", "running"), ("303", "3", "1", "booting")]


def test_no_workers_is_a_header_without_rows() -> None:
    text = render(snapshot([], state="booting", ready=False))
    above, _, rows = table(text)
    assert rows == []
    assert above[0].endswith("sync workers 0")


def test_row_values() -> None:
    w = worker(4194303, 12, generation=7, state="stopping", age=3725.9, requests_served=123456,
               in_flight_requests=2, active_connections=3, background_tasks=1,
               rss_bytes=int(1.5 * 1024 ** 3), seconds_since_heartbeat=12.34)
    _, _, rows = table(render(snapshot([w])))
    assert rows == [{"PID": "4194303", "WORKER": "12", "GEN": "7", "STATE": "stopping",
                     "AGE": "1h02m", "REQUESTS": "123456", "IN FLIGHT": "2", "CONNS": "3",
                     "BG": "1", "RSS": "1.5G", "HEARTBEAT": "12.3s"}]


def test_columns_are_aligned_with_cells_wider_and_narrower_than_their_names() -> None:
    workers = [
        worker(7, 1, requests_served=0, rss_bytes=512, age=0),
        worker(4194303, 123, generation=10, state="stopping", requests_served=98765432,
               in_flight_requests=1000, active_connections=12345, background_tasks=77,
               rss_bytes=3 * 1024 ** 3, age=200000, seconds_since_heartbeat=1234.5),
        worker(55555, 9, state="booting", booted=False, rss_bytes=0),
    ]
    text = render(snapshot(workers))
    assert_aligned(text)
    column_header = text.splitlines()[3]
    assert column_header.startswith("PID"), column_header
    assert column_header == column_header.rstrip()


@pytest.mark.parametrize("rss, shown", [
    (0, "0B"),
    (512, "512B"),
    (1536, "1.5K"),
    (20 * 1024 * 1024 + 200 * 1024, "20.2M"),
    (3 * 1024 ** 3, "3.0G"),
    (2048 * 1024 ** 3, "2048.0G"),  # G is the largest unit
])
def test_rss_in_human_units(rss: int, shown: str) -> None:
    _, _, rows = table(render(snapshot([worker(1, 1, rss_bytes=rss)])))
    assert rows[0]["RSS"] == shown


@pytest.mark.parametrize("seconds, shown", [
    (0, "0s"),
    (0.9, "0s"),
    (59, "59s"),
    (60, "1m00s"),
    (61, "1m01s"),
    (3599, "59m59s"),
    (3600, "1h00m"),
    (3720, "1h02m"),
    (86399, "23h59m"),
    (86400, "1d00h"),
    (90061, "1d01h"),
    (-5, "0s"),  # clock skew never shows a negative age
])
def test_durations(seconds: float, shown: str) -> None:
    text = render(snapshot([worker(1, 1, age=seconds)], uptime=seconds))
    assert f"  up {shown}  " in text.splitlines()[0]
    _, _, rows = table(text)
    assert rows[0]["AGE"] == shown


# -- snapshots with fields missing (an older or newer server) -----------------------------------

def test_missing_optional_worker_fields_are_tolerated() -> None:
    bare = [{"pid": 11, "worker_id": 1, "generation": 1, "booted": True},
            {"pid": 12, "worker_id": 2, "generation": 1, "booted": False},
            {"pid": 13, "worker_id": 3, "generation": 1}]
    text = render(snapshot(bare))
    assert_aligned(text)
    _, _, rows = table(text)
    # No state: derived from booted. No numbers: zero.
    assert [r["STATE"] for r in rows] == ["running", "booting", "booting"]
    for row in rows:
        assert (row["AGE"], row["REQUESTS"], row["IN FLIGHT"], row["CONNS"], row["BG"],
                row["RSS"], row["HEARTBEAT"]) == ("0s", "0", "0", "0", "0", "0B", "0.0s")


def test_missing_optional_arbiter_fields_are_tolerated() -> None:
    snap = {"state": "running", "ready": True, "pid": 4242, "generation": 1,
            "workers": [worker(101, 1)]}
    text = render(snap)
    lines = text.splitlines()
    assert lines[0].startswith("forkserve ? ")  # no version
    assert "  up 0s  " in lines[0]
    assert lines[0].endswith("workers 1")
    assert lines[1] == "in flight 0  connections 0  background 0"
    _, _, rows = table(text)
    assert [r["PID"] for r in rows] == ["101"]


def test_a_snapshot_without_workers_is_tolerated() -> None:
    text = render({"state": "booting", "ready": False, "pid": 4242, "generation": 1})
    above, _, rows = table(text)
    assert rows == []
    assert "booting (not ready)" in above[0]
    assert above[0].endswith("workers 0")
