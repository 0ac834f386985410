"""Your own Prometheus metrics next to forkserve's: prometheus_client's multiprocess mode.

Every worker is a process of its own, so prometheus_client keeps metrics in files in
``PROMETHEUS_MULTIPROC_DIR``. forkserve sets that up for you (a private directory, removed at
exit, or the one you set): create metrics at import as usual, and the status server's
``/metrics`` shows them summed across workers, beside ``forkserve_requests_total`` and the
rest; a worker that exits (``--max-requests``, a reload) leaves its counts in the totals.
Gauges need a ``live*`` mode, so a dead worker's value goes with it.

    forkserve examples.metrics:app --status-bind 127.0.0.1:9100
    curl 'http://127.0.0.1:8000/orders?payment=card'; curl -s http://127.0.0.1:9100/metrics | grep shop_
"""

from urllib.parse import parse_qs

from prometheus_client import Counter, Gauge, Histogram

ORDERS = Counter("shop_orders", "Orders placed, by payment method", ["payment"])
ORDER_VALUE = Histogram("shop_order_value_euros", "Value of the orders placed",
                        buckets=(5, 10, 50, 100, 500))
IN_PROGRESS = Gauge("shop_orders_in_progress", "Orders being placed now",
                    multiprocess_mode="livesum")
PAYMENTS = ("card", "cash", "invoice")  # a label's values are a small, fixed set


def app(environ, start_response):
    query = {k: v[0] for k, v in parse_qs(environ["QUERY_STRING"]).items()}
    payment = query.get("payment", "card")
    if payment not in PAYMENTS:
        return respond(start_response, "400 Bad Request", b"payment: card, cash or invoice\n")
    with IN_PROGRESS.track_inprogress():
        ORDERS.labels(payment=payment).inc()
        ORDER_VALUE.observe(float(query.get("value", "20")))
    return respond(start_response, "201 Created", b"order placed\n")


def respond(start_response, status, body):
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
