"""Tracing in one place: one tracer provider per process, OTLP export when configured."""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_provider: TracerProvider | None = None


def configure_telemetry(
    service: str, *, processors: list[SpanProcessor] | None = None
) -> TracerProvider:
    """Install the process's tracer provider (idempotent: later calls only add processors).

    OTLP/HTTP export is on when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; tests pass an
    in-memory exporter through `processors`.
    """
    global _provider
    if _provider is None:
        _provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(_provider)
    for processor in processors or []:
        _provider.add_span_processor(processor)
    return _provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)
