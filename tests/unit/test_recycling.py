"""Worker recycling and the request timeout, the pure parts (issue 15): the RETIRING record's
reason, the arbiter's classification of a retired worker, the settings, and which timed
requests are overdue (the real processes: tests/integration/test_limits.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from forkserve.arbiter.workers import WorkerHandle
from forkserve.config import ConfigError, parse_args, resolve
from forkserve.context import RequestCancelled, RequestContext, RequestTimedOut
from forkserve.counters import RETIRE_REASONS, Decoder, Kind, Record, encode, retiring_reason, \
    retiring_text
from forkserve.metrics import RESTART_REASONS
from forkserve.workers.pipeline import Pipeline


@pytest.mark.parametrize("reason", RETIRE_REASONS)
def test_a_retiring_record_carries_its_reason_and_figure(reason: str) -> None:
    text = retiring_text(reason, "RSS 212 MiB, past --max-worker-rss 200 MiB (+3 MiB jitter)")
    [record] = Decoder().feed(encode(Record(Kind.RETIRING, 1, 100, text=text)))
    assert retiring_reason(record.text) == (reason, text.partition("\t")[2])
    handle = WorkerHandle(1, 1, pid=100, booted=True)
    handle.take(record, 1.0)
    assert handle.stopping and handle.exit_reason() == reason.replace("-", "_")
    assert handle.exit_reason() in RESTART_REASONS  # counted (and exported at zero) by reason


def test_a_text_without_a_reason_is_max_requests() -> None:
    assert retiring_reason("served 50 requests") == ("max-requests", "served 50 requests")


@pytest.mark.parametrize("argv, values", [
    ([], (0, 0, 0.0, 0.0, 0.0)),
    (["--max-worker-rss", "512", "--max-worker-rss-jitter", "64", "--max-worker-lifetime",
      "3600", "--max-worker-lifetime-jitter", "600", "--request-timeout", "30"],
     (512, 64, 3600.0, 600.0, 30.0)),
])
def test_settings(argv: list[str], values: tuple[Any, ...]) -> None:
    config = resolve(parse_args([*argv, "app:wsgi"], "test")[0], {})
    assert (config.max_worker_rss, config.max_worker_rss_jitter, config.max_worker_lifetime,
            config.max_worker_lifetime_jitter, config.request_timeout) == values


@pytest.mark.parametrize("argv", [["--max-worker-rss", "-1"], ["--max-worker-rss", "1.5"],
                                  ["--max-worker-lifetime", "-3"], ["--request-timeout", "nan"]])
def test_bad_values_are_refused(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match=argv[0]):
        resolve(parse_args([*argv, "app:wsgi"], "test")[0], {})


def test_env_and_yaml_names() -> None:
    config = resolve(parse_args(["app:wsgi"], "test")[0],
                     {"FORKSERVE_MAX_WORKER_RSS": "300", "FORKSERVE_REQUEST_TIMEOUT": "2.5"})
    assert (config.max_worker_rss, config.request_timeout) == (300, 2.5)
    assert config.sources["max_worker_rss"] == "env"


class Conn(str):
    """A connection as the timing methods see it: a name, and whether an app took it."""
    taken = False


def timing(*deadlines: float) -> tuple[Any, list[RequestContext]]:
    """A stand-in with what Pipeline's timing methods use: requests timed at ``deadlines``."""
    contexts = [RequestContext(lambda: None) for _ in deadlines]
    conns = [Conn(f"conn-{i}") for i in range(len(deadlines))]
    worker = SimpleNamespace(timing={c: (d, conn) for c, d, conn in
                                     zip(contexts, deadlines, conns)},
                             fired=set(), request_timeout=5.0)
    return worker, contexts


def test_overdue_requests_are_taken_once_in_the_order_they_began() -> None:
    worker, (a, b, c) = timing(10.0, 11.0, 12.0)
    assert Pipeline.next_request_deadline(worker, 0.0) == 10.0
    assert Pipeline.overdue_requests(worker, 11.0) == [(a, "conn-0"), (b, "conn-1")]
    assert a.timed_out and a.cancelled and worker.fired == {a, b}
    assert Pipeline.overdue_requests(worker, 11.5) == []  # never a second cancel
    assert Pipeline.next_request_deadline(worker, 11.5) == 12.0
    Pipeline.untime_request(worker, a)
    assert worker.fired == {b}
    Pipeline.untime_request(worker, c)  # ended in time
    assert Pipeline.next_request_deadline(worker, 20.0) == 25.0  # none timed: now + timeout


def test_a_request_the_drain_cancelled_first_gets_no_timeout() -> None:
    worker, (a,) = timing(10.0)
    a.cancelled = True
    assert Pipeline.overdue_requests(worker, 11.0) == [] and not a.timed_out
    assert worker.timing == {}


def test_a_timeout_is_a_request_cancelled() -> None:
    assert issubclass(RequestTimedOut, RequestCancelled)
    assert "--request-timeout" in RequestTimedOut().reason


def test_a_taken_connection_is_never_timed_out() -> None:
    """A WebSocket (the app took the socket) outlives --request-timeout: dropped, not fired."""
    worker, (a, b) = timing(10.0, 11.0)
    conn = worker.timing[a][1]
    conn.taken = True
    assert Pipeline.overdue_requests(worker, 12.0) == [(b, "conn-1")]
    assert not a.cancelled and worker.fired == {b} and a not in worker.timing
