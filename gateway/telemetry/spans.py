"""Request traces with the OpenTelemetry SDK: one span per request, children for queue wait,
prefill and decode, built when the request ends from the gateway's and the worker's clocks.

Finished spans go to every configured outlet: OTLP/HTTP to a collector, the live feed (as
OTLP JSON) and, in tests, an in-memory exporter. A client's W3C `traceparent` continues its
trace.
"""
from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from billing.request_finished import RequestFinished
from contract.outputs import wall_clock

PROPAGATOR = TraceContextTextMapPropagator()


def _ns(unix_seconds: float) -> int:
    return int(unix_seconds * 1e9)


class FeedSpanProcessor(SpanProcessor):
    """Hands each finished span, as OTLP JSON, to a callback (the live feed)."""

    def __init__(self, publish):
        self.publish = publish

    def on_end(self, span: ReadableSpan) -> None:
        self.publish(span_to_otlp_json(span))


class Telemetry:
    def __init__(self, service_name: str = "inferstack-gateway", otlp_endpoint: str | None = None,
                 in_memory: bool = False, publish=None):
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.memory = InMemorySpanExporter() if in_memory else None
        if self.memory is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(self.memory))
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        if publish is not None:
            self.provider.add_span_processor(FeedSpanProcessor(publish))
        self.tracer = self.provider.get_tracer("inferstack.gateway")

    def shutdown(self) -> None:
        self.provider.shutdown()

    def request_finished(self, done: RequestFinished) -> None:
        """Record a finished request as spans: the request, and its queue, prefill and
        decode (and KV transfer) from the gateway's and the worker's clocks."""
        start = wall_clock(done.enqueued_at)
        end = wall_clock(done.settled_at)
        parent = PROPAGATOR.extract(done.trace_headers or {})
        root = self.tracer.start_span("llm.request", context=parent, kind=SpanKind.SERVER,
                                      start_time=_ns(start), attributes=_attributes(done))
        ctx = trace.set_span_in_context(root)
        dispatched = wall_clock(done.dispatched_at)
        if dispatched is not None:
            self._child("queue", ctx, start, dispatched)
        timing = done.worker_timing or {}
        scheduled, first = timing.get("scheduled") or dispatched, timing.get("first_token")
        if scheduled is not None and first is not None:
            self._child("prefill", ctx, scheduled, first,
                        {"cached_tokens": done.cached_tokens,
                         "prompt_tokens": done.prompt_tokens})
            self._child("decode", ctx, first, timing.get("finished") or end,
                        {"output_tokens": done.completion_tokens})
        if timing.get("kv_transfer"):  # prefill/decode disaggregation moved the prompt's KV
            self._child("kv_transfer", ctx, *timing["kv_transfer"])
        root.set_status(Status(StatusCode.ERROR if done.failed else StatusCode.OK))
        root.end(end_time=_ns(end))

    def _child(self, name: str, ctx, start: float, end: float, attributes=None) -> None:
        span = self.tracer.start_span(name, context=ctx, start_time=_ns(start),
                                      attributes=attributes or {})
        span.end(end_time=_ns(max(start, end)))


def _attributes(done: RequestFinished) -> dict:
    attrs = {"request.id": done.request_id, "priority": done.priority,
             "gen_ai.request.model": done.model or "",
             "gen_ai.usage.input_tokens": done.prompt_tokens,
             "gen_ai.usage.output_tokens": done.completion_tokens,
             "cached_tokens": done.cached_tokens, "tenant": done.tenant,
             "finish_reason": done.reasons_text or "none"}
    if done.worker_index is not None:
        attrs["worker"] = done.worker_index
        attrs["device"] = done.device or ""
    for k, v in done.cost.as_dict().items():
        if k != "currency":
            attrs[f"cost.{k}"] = v
    if done.ttft_seconds is not None:
        attrs["ttft_s"] = done.ttft_seconds
    spec = (done.worker_timing or {}).get("spec_acceptance")
    if spec is not None:
        attrs["spec.acceptance"] = spec
    return attrs


def _value(v) -> dict:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def span_to_otlp_json(span: ReadableSpan) -> dict:
    """One span in the OTLP/JSON shape (hex ids, string nanoseconds)."""
    ctx = span.get_span_context()
    parent = span.parent
    return {"traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}",
            "parentSpanId": f"{parent.span_id:016x}" if parent is not None else "",
            "name": span.name, "kind": int(span.kind.value) + 1,
            "startTimeUnixNano": str(span.start_time), "endTimeUnixNano": str(span.end_time),
            "attributes": [{"key": k, "value": _value(v)}
                           for k, v in (span.attributes or {}).items()],
            "status": {"code": {StatusCode.UNSET: 0, StatusCode.OK: 1,
                                StatusCode.ERROR: 2}[span.status.status_code]}}
