"""Spans to an OpenTelemetry SDK tracer provider, flushed before every worker exits.

The app sets up the SDK the usual way, at import: a global ``TracerProvider`` whose
``BatchSpanProcessor`` buffers spans and exports them in batches (every 5 s by default, or
``OTEL_BSP_SCHEDULE_DELAY`` ms). Workers leave with ``os._exit``, so the SDK's own exit hook
never runs; forkserve sees the SDK imported and flushes (then shuts down) the provider before
a worker exits (a stop, a reload, ``--max-requests``): the last batch is never lost. Spans the
app records with ``forkserve.telemetry.span`` go to the same provider (and to ``--span-log``).

Here the exporter prints each span as one JSON line on standard output; use
``OTLPSpanExporter`` (opentelemetry-exporter-otlp) for a collector.

    forkserve examples.otel:app
    curl 'http://127.0.0.1:8000/checkout?cart=7'    # then Ctrl-C: the spans are printed
"""

from urllib.parse import parse_qs

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

import forkserve

provider = TracerProvider(resource=Resource.create({"service.name": "shop"}))
provider.add_span_processor(BatchSpanProcessor(
    ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n")))
trace.set_tracer_provider(provider)
tracer = trace.get_tracer("examples.otel")


def app(environ, start_response):
    cart = parse_qs(environ["QUERY_STRING"]).get("cart", ["0"])[0]
    with tracer.start_as_current_span("checkout", attributes={"cart": cart}):
        with forkserve.telemetry.span("price-cart", cart=cart):  # forkserve's own span API
            body = f"cart {cart} checked out\n".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
