"""An app that uses the OpenTelemetry SDK the usual way: a global TracerProvider with a
BatchSpanProcessor, which buffers spans in the worker (here for up to a minute)."""

import os

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import forkserve


class FileExporter(SpanExporter):
    def __init__(self, path):
        self.path = path

    def export(self, spans):
        with open(self.path, "a", encoding="utf-8") as fh:
            for span in spans:
                fh.write(span.name + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self):
        return None


provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(FileExporter(os.environ["TESTAPP_OTEL_OUT"]),
                                               schedule_delay_millis=60_000))
trace.set_tracer_provider(provider)
tracer = trace.get_tracer("tests.apps.otel")


def app(environ, start_response):
    n = environ["QUERY_STRING"] or "0"
    with tracer.start_as_current_span(f"app-{n}"):
        with forkserve.telemetry.span(f"forkserve-{n}"):
            body = b"traced"
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]
