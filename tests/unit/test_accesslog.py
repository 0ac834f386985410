"""forkserve.telemetry.accesslog: line formats (combined, json, templates), escaping of hostile
values, X-Request-ID sanity and generation, and reopen() (logrotate) losing and duplicating
nothing, also while other threads log and flush."""

from __future__ import annotations

import calendar
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from forkserve.config import ACCESS_LOG_FIELDS
from forkserve.telemetry import accesslog
from forkserve.telemetry.accesslog import FLUSH_AT, REQUEST_ID_MAX, AccessLog, RequestIds

STARTED = 1700000000.25  # 14/Nov/2023:22:13:20 +0000
APACHE_TIME = "14/Nov/2023:22:13:20 +0000"
ISO_TIME = "2023-11-14T22:13:20.250Z"

# One quoted field of a combined line: anything but a bare quote, backslash escapes allowed.
QUOTED = r'"((?:[^"\\]|\\.)*)"'
COMBINED = re.compile(
    r'(?P<remote>\S+) - - \[(?P<time>[^\]]+)\] "(?P<method>\S+) (?P<target>(?:[^"\\ ]|\\.)+) '
    r'(?P<protocol>HTTP/1\.[01])" (?P<status>\d{3}) (?P<size>\d+|-) ' + QUOTED.replace("(", "(?P<referer>", 1)
    + " " + QUOTED.replace("(", "(?P<agent>", 1) + r" (?P<duration>\d+\.\d{6}) (?P<request_id>\S+)\n")

# What a hostile client can put in a request line or a header (decoded as latin-1 by the
# server): quotes, backslashes, CR/LF, NUL, ESC (terminal escapes), DEL, C1 controls
# (NEL, CSI) and Unicode line separators.
HOSTILE = 'a"b\\c\r\nd\x00e\x1b[31mf\x7fg\x85h\x9bi\u2028j\u2029k\tl'


def request(log: AccessLog, **overrides: Any) -> None:
    values: dict[str, Any] = dict(
        remote="10.1.2.3", method="GET", target="/a/b?x=1&y=2", protocol="HTTP/1.1", status=200,
        size=1234, referer="http://ref.example/", agent="curl/8.0", started=STARTED,
        duration=0.0123456, request_id="req-1")
    values.update(overrides)
    log.request(**values)


def content(path: Path) -> str:
    return path.read_bytes().decode("utf-8") if path.exists() else ""


def lines_of(path: Path) -> list[str]:
    """Lines as a log reader sees them: split at LF only, each one kept with its LF."""
    text = content(path)
    assert text == "" or text.endswith("\n"), f"a partial last line in {path}: {text[-200:]!r}"
    return [line + "\n" for line in text.split("\n")[:-1]]


def one_line(path: Path) -> str:
    text = content(path)
    assert text.endswith("\n") and text.count("\n") == 1, repr(text)
    return text


def no_raw_controls(line: str) -> bool:
    """Nothing in the line but printable text and its one terminating LF."""
    return line.endswith("\n") and line[:-1].isprintable()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "access.log"


# -- json ------------------------------------------------------------------------------------

def test_json_line_fields_and_types(path: Path) -> None:
    log = AccessLog(str(path), "json")
    request(log)
    request(log, method="POST", target="/echo", status=404, size=0, referer=None, agent=None,
            duration=0.0, request_id="generated-2")
    assert content(path) == "", "lines are buffered until a flush"
    log.close()
    first, second = (json.loads(line) for line in lines_of(path))
    assert first == {
        "time": APACHE_TIME, "time_iso": ISO_TIME, "remote_addr": "10.1.2.3", "method": "GET",
        "path": "/a/b", "query": "x=1&y=2", "target": "/a/b?x=1&y=2", "protocol": "HTTP/1.1",
        "status": 200, "bytes": 1234, "duration_us": 12345, "duration": first["duration"],
        "referer": "http://ref.example/", "user_agent": "curl/8.0", "request_id": "req-1",
        "pid": os.getpid(),
    }
    for name in ("status", "bytes", "duration_us", "pid"):
        assert type(first[name]) is int, (name, first[name])
    assert float(first["duration"]) == pytest.approx(0.012346)
    assert second["path"] == "/echo" and second["query"] == "" and second["target"] == "/echo"
    assert (second["status"], second["bytes"], second["duration_us"]) == (404, 0, 0)
    assert float(second["duration"]) == 0.0
    assert second["referer"] == "-" and second["user_agent"] == "-"


def test_json_keys_are_exactly_the_configured_fields(path: Path) -> None:
    log = AccessLog(str(path), "json")
    request(log)
    log.close()
    record = json.loads(one_line(path))
    assert set(record) == set(ACCESS_LOG_FIELDS)
    assert len(record) == len(ACCESS_LOG_FIELDS)


def test_json_hostile_values_round_trip_on_one_line(path: Path) -> None:
    log = AccessLog(str(path), "json")
    request(log, target="/p" + HOSTILE + "?q=" + HOSTILE, agent=HOSTILE, referer=HOSTILE,
            request_id=HOSTILE, method="GE\"T")
    log.close()
    line = one_line(path)
    record = json.loads(line)
    assert record["path"] == "/p" + HOSTILE
    assert record["query"] == "q=" + HOSTILE
    assert record["user_agent"] == HOSTILE and record["referer"] == HOSTILE
    assert record["request_id"] == HOSTILE and record["method"] == 'GE"T'
    assert not re.search(r"[\x00-\x1f]", line[:-1]), repr(line)


def test_json_escapes_c1_controls(path: Path) -> None:
    """Headers are latin-1 text, so a client's bytes 0x80-0x9f reach the log as C1 controls:
    NEL (0x85) is a line break to str.splitlines() and Unicode-aware readers, CSI (0x9b) a
    terminal escape. combined and templates escape them (_quote); json must too."""
    log = AccessLog(str(path), "json")
    request(log, agent="ua\x85nel\x9bcsi\x80", target="/p?q=\x85")
    log.close()
    line = one_line(path)
    assert json.loads(line)["user_agent"] == "ua\x85nel\x9bcsi\x80"
    assert len(line.splitlines()) == 1, f"the line splits at NEL: {line.splitlines()!r}"
    assert no_raw_controls(line), repr(line)


# -- templates --------------------------------------------------------------------------------

def test_template_names_every_field(path: Path) -> None:
    template = "|".join("{%s}" % name for name in ACCESS_LOG_FIELDS)
    log = AccessLog(str(path), template)
    request(log)
    log.close()
    values = one_line(path)[:-1].split("|")
    got = dict(zip(ACCESS_LOG_FIELDS, values))
    assert len(values) == len(ACCESS_LOG_FIELDS)
    assert got == {
        "time": APACHE_TIME, "time_iso": ISO_TIME, "remote_addr": "10.1.2.3", "method": "GET",
        "path": "/a/b", "query": "x=1&y=2", "target": "/a/b?x=1&y=2", "protocol": "HTTP/1.1",
        "status": "200", "bytes": "1234", "duration_us": "12345", "duration": "0.012346",
        "referer": "http://ref.example/", "user_agent": "curl/8.0", "request_id": "req-1",
        "pid": str(os.getpid()),
    }


def test_template_example_and_format_specs(path: Path) -> None:
    log = AccessLog(str(path), "{remote_addr} {method} {path} {status} {duration_us} {request_id}")
    request(log)
    log.flush()
    assert content(path) == "10.1.2.3 GET /a/b 200 12345 req-1\n"
    log.close()
    padded = path.with_name("padded.log")
    log = AccessLog(str(padded), "[{status:>5}] {bytes:08d} {{literal}}")
    request(log, status=204, size=7)
    log.close()
    assert content(padded) == "[  204] 00000007 {literal}\n"


def test_template_escapes_hostile_values(path: Path) -> None:
    log = AccessLog(str(path), '{method} "{target}" "{path}" "{query}" "{referer}" '
                                '"{user_agent}" {request_id}')
    request(log, target="/p" + HOSTILE + "?q=" + HOSTILE, agent=HOSTILE, referer=HOSTILE,
            request_id=HOSTILE, method='GE"T')
    log.close()
    line = one_line(path)
    assert no_raw_controls(line), repr(line)
    match = re.fullmatch(r'(\S+) ' + " ".join([QUOTED] * 5) + r' (\S+)\n', line)
    assert match, repr(line)
    assert match[1] == 'GE\\"T'
    assert '\\"' in match[6] and "\\r\\n" in match[6] and "\\\\" in match[6]


# -- combined -----------------------------------------------------------------------------------

def test_combined_line(path: Path) -> None:
    log = AccessLog(str(path), "combined")
    request(log)
    request(log, method="HEAD", target="/", size=0, referer=None, agent=None, duration=1.5)
    log.close()
    first, second = lines_of(path)
    assert first == ('10.1.2.3 - - [14/Nov/2023:22:13:20 +0000] "GET /a/b?x=1&y=2 HTTP/1.1" 200 '
                     '1234 "http://ref.example/" "curl/8.0" 0.012346 req-1\n')
    assert second == ('10.1.2.3 - - [14/Nov/2023:22:13:20 +0000] "HEAD / HTTP/1.1" 200 - "-" "-" '
                      '1.500000 req-1\n')


def test_combined_escapes_hostile_values(path: Path) -> None:
    log = AccessLog(str(path), "combined")
    request(log, target="/p" + HOSTILE, agent=HOSTILE, referer=HOSTILE, request_id="ok\\id")
    log.close()
    line = one_line(path)
    assert no_raw_controls(line), repr(line)
    match = COMBINED.fullmatch(line)
    assert match, repr(line)
    assert match["agent"] == match["referer"]
    assert match["agent"].startswith('a\\"b\\\\c\\r\\nd\\x00e\\x1b[31mf\\x7fg')
    assert match["target"].startswith('/pa\\"b')
    assert match["request_id"] == "ok\\\\id"


def test_time_is_the_request_start_in_utc(path: Path) -> None:
    log = AccessLog(str(path), "{time}|{time_iso}")
    for started in (STARTED, STARTED + 1.999, 0.0):
        request(log, started=started)
    log.close()
    got = [line[:-1].split("|") for line in lines_of(path)]
    assert got == [[APACHE_TIME, ISO_TIME],
                   ["14/Nov/2023:22:13:22 +0000", "2023-11-14T22:13:22.249Z"],
                   ["01/Jan/1970:00:00:00 +0000", "1970-01-01T00:00:00.000Z"]]
    parsed = calendar.timegm(time.strptime(got[0][0], "%d/%b/%Y:%H:%M:%S +0000"))
    assert parsed == int(STARTED)


def test_time_of_concurrent_requests(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Request threads share the per-second timestamp cache. A thread switch can come at any
    call: here, while one thread formats the stamp of a new second, another logs a request of
    that same second. Each line must still carry its own request's start time."""
    log = AccessLog(str(path), "{time} {request_id}")
    request(log, started=STARTED, request_id="earlier")
    real_strftime = time.strftime
    switched = []

    def strftime_with_a_switch(fmt: str, when: Any) -> str:
        if fmt.startswith("%d/%b") and not switched:
            switched.append(True)
            other = threading.Thread(target=request, args=(log,),
                                     kwargs={"started": STARTED + 1, "request_id": "other"})
            other.start()
            other.join(10)
        return real_strftime(fmt, when)

    monkeypatch.setattr(accesslog, "time", SimpleNamespace(strftime=strftime_with_a_switch,
                                                           gmtime=time.gmtime))
    request(log, started=STARTED + 1, request_id="this")
    monkeypatch.undo()
    log.close()
    assert switched
    assert sorted(lines_of(path)) == sorted([
        f"{APACHE_TIME} earlier\n", "14/Nov/2023:22:13:21 +0000 other\n",
        "14/Nov/2023:22:13:21 +0000 this\n"])


# -- buffering, reopen ------------------------------------------------------------------------

def test_buffered_until_flush_or_buffer_full(path: Path) -> None:
    log = AccessLog(str(path), "{path}")
    request(log, target="/small")
    assert content(path) == ""
    log.flush()
    assert content(path) == "/small\n"
    big = "/" + "x" * 999
    count = FLUSH_AT // 1001 + 1
    for _ in range(count):
        request(log, target=big)
    # The line that took the buffer past FLUSH_AT was written with all before it.
    assert content(path) == "/small\n" + (big + "\n") * count
    log.close()


def test_reopen_after_rename(path: Path) -> None:
    log = AccessLog(str(path), "{path}")
    request(log, target="/flushed-before")
    log.flush()
    rotated = path.with_name("access.log.1")
    path.rename(rotated)
    request(log, target="/buffered-before")  # still in memory while the file is renamed
    log.reopen()
    assert path.exists() and content(path) == ""
    request(log, target="/after")
    log.close()
    assert content(rotated) == "/flushed-before\n/buffered-before\n"
    assert content(path) == "/after\n"


def test_reopen_with_nothing_buffered(path: Path) -> None:
    log = AccessLog(str(path), "{path}")
    path.rename(path.with_name("gone"))
    log.reopen()
    log.reopen()
    request(log, target="/x")
    log.close()
    assert content(path) == "/x\n"
    assert content(path.with_name("gone")) == ""


def test_concurrent_logging_and_flushing_while_rotating(tmp_path: Path) -> None:
    """8 request threads log 2000 lines each (flushing now and then, and on a full buffer)
    while a rotator renames the file and reopens: every line lands whole, exactly once."""
    path = tmp_path / "access.log"
    log = AccessLog(str(path), "json")
    threads, per_thread = 8, 2000
    done = threading.Event()
    failures: list[BaseException] = []
    rotations = [0]
    start = threading.Barrier(threads + 1)

    def writer(t: int) -> None:
        try:
            start.wait(10)
            for i in range(per_thread):
                request(log, target=f"/t{t}/{i}?pad=" + "p" * (i % 200), request_id=f"{t}-{i}")
                if i % 61 == 0:
                    log.flush()
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    def rotator() -> None:
        try:
            start.wait(10)
            while not done.is_set():
                if path.exists() and path.stat().st_size > 0:
                    rotations[0] += 1
                    path.rename(tmp_path / f"access.log.{rotations[0]}")
                    log.reopen()
                done.wait(0.002)  # pace the rotations; the writers never wait on this
        except BaseException as exc:
            failures.append(exc)

    workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    rotating = threading.Thread(target=rotator)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many more thread switches: races show up, if any
    try:
        for thread in [*workers, rotating]:
            thread.start()
        for thread in workers:
            thread.join(60)
        done.set()
        rotating.join(10)
    finally:
        sys.setswitchinterval(switch_interval)
    assert not any(t.is_alive() for t in [*workers, rotating]), "threads did not finish"
    log.close()
    assert not failures, failures

    seen: dict[str, int] = {}
    for file in tmp_path.glob("access.log*"):
        for line in lines_of(file):
            record = json.loads(line)  # every line whole
            seen[record["request_id"]] = seen.get(record["request_id"], 0) + 1
    expected = {f"{t}-{i}" for t in range(threads) for i in range(per_thread)}
    missing = expected - set(seen)
    duplicated = {k: n for k, n in seen.items() if n != 1}
    assert not missing and not duplicated and set(seen) == expected, (
        f"{len(missing)} lost (e.g. {sorted(missing)[:5]}), {len(duplicated)} duplicated "
        f"(e.g. {sorted(duplicated.items())[:5]}) over {rotations[0]} rotations")
    print(f"{rotations[0]} rotations")
    assert rotations[0] >= 3, f"only {rotations[0]} rotations happened during the writes"


# -- X-Request-ID -------------------------------------------------------------------------------

@pytest.mark.parametrize("incoming", [
    "abc-123", "f47ac10b-58cc-4372-a567-0e02b2c3d479", "a" * REQUEST_ID_MAX, "x",
    "trace=1;span/2:ok", "caf\xe9", "back\\slash",
])
def test_sane_request_ids_are_kept(incoming: str) -> None:
    assert RequestIds().take(incoming) == incoming


@pytest.mark.parametrize("incoming", [
    None, "", "a" * (REQUEST_ID_MAX + 1), "a" * 300, "has space", 'has"quote', "new\nline",
    "cr\rlf", "nul\x00", "tab\tbed", "esc\x1b[2J", "del\x7f", "nel\x85", "nbsp\xa0x",
    "sep\u2028", " ", '"',
], ids=lambda v: repr(v)[:20])
def test_bad_request_ids_are_replaced(incoming: str | None) -> None:
    ids = RequestIds()
    got = ids.take(incoming)
    assert got != incoming
    assert re.fullmatch(r"[0-9a-f]{16}-[0-9a-f]+", got), got
    assert ids.take(got) == got, "a generated id is itself sane"


def test_generated_ids_are_unique() -> None:
    ids = RequestIds()
    generated = [ids.take(None) for _ in range(10_000)]
    assert len(set(generated)) == 10_000
    assert all(len(g) <= REQUEST_ID_MAX and " " not in g for g in generated)
    # Another worker (or a restarted one) has another prefix.
    others = {RequestIds().take(None) for _ in range(20)}
    assert len(others) == 20 and not others & set(generated)


def test_generated_ids_are_unique_across_threads() -> None:
    ids = RequestIds()
    results: list[list[str]] = [[] for _ in range(8)]

    def take(bucket: list[str]) -> None:
        for _ in range(2000):
            bucket.append(ids.take(""))

    threads = [threading.Thread(target=take, args=(bucket,)) for bucket in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    everything = [i for bucket in results for i in bucket]
    assert len(everything) == 16_000 and len(set(everything)) == 16_000
