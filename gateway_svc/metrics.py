"""Prometheus metrics of the gateway, in a registry of its own (no module-level globals).

    pagoda_gateway_requests_total{endpoint, status}       responses by HTTP status
    pagoda_gateway_request_duration_seconds{endpoint}     until the response started
    pagoda_gateway_requests_in_flight                     requests being served (streams included)
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("pagoda_gateway_requests", "HTTP responses", ["endpoint", "status"],
                                registry=self.registry)
        self.duration = Histogram("pagoda_gateway_request_duration_seconds", "time to the response's start",
                                  ["endpoint"], registry=self.registry)
        self.in_flight = Gauge("pagoda_gateway_requests_in_flight", "requests being served", registry=self.registry)
        metrics = self

        class Middleware:
            """Pure ASGI (not BaseHTTPMiddleware), so streaming and disconnects pass untouched."""

            def __init__(self, app):
                self.app = app

            async def __call__(self, scope, receive, send):
                if scope["type"] != "http":
                    return await self.app(scope, receive, send)
                endpoint, start = scope["path"], time.perf_counter()

                async def counted_send(message):
                    if message["type"] == "http.response.start":
                        metrics.requests.labels(endpoint, str(message["status"])).inc()
                        metrics.duration.labels(endpoint).observe(time.perf_counter() - start)
                    await send(message)

                metrics.in_flight.inc()
                try:
                    await self.app(scope, receive, counted_send)
                finally:
                    metrics.in_flight.dec()

        self.middleware = Middleware

    def render(self) -> bytes:
        return generate_latest(self.registry)
