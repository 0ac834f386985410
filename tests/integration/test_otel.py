"""Spans buffered by an app's OpenTelemetry BatchSpanProcessor reach the exporter before a
worker exits (workers leave with os._exit, so the SDK's own atexit hook never runs)."""

from __future__ import annotations

import signal

import requests


def test_buffered_otel_spans_are_flushed_at_exit(server_factory, tmp_path):
    out = tmp_path / "spans"
    out.touch()
    server = server_factory(app="tests.apps.otel:app",
                            env={"TESTAPP_OTEL_OUT": str(out)}).wait_ready()
    for n in range(10):
        assert requests.get(f"{server.url}/?{n}", timeout=10).text == "traced"
    assert out.read_text() == "", "the batch processor should still hold the spans"
    server.signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
    names = sorted(out.read_text().split())
    assert names == sorted([f"app-{n}" for n in range(10)] + [f"forkserve-{n}" for n in range(10)])


def test_buffered_otel_spans_are_flushed_when_a_worker_retires(server_factory, tmp_path):
    out = tmp_path / "spans"
    out.touch()
    server = server_factory("--max-requests", "3", app="tests.apps.otel:app", workers=1,
                            env={"TESTAPP_OTEL_OUT": str(out)}).wait_ready()
    for n in range(3):
        assert requests.get(f"{server.url}/?{n}", timeout=10).text == "traced"
    server.wait_log("retired")
    names = sorted(out.read_text().split())
    assert names == sorted([f"app-{n}" for n in range(3)] + [f"forkserve-{n}" for n in range(3)])
