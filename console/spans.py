"""OTLP/JSON spans from the feed folded into one `Trace` per request (pure data, no UI)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

ROOT_SPAN = "llm.request"


@dataclass(frozen=True)
class Span:
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int = 0

    @property
    def duration_s(self) -> float:
        return max(self.end_ns - self.start_ns, 0) / 1e9


@dataclass
class Trace:
    """One request: its root `llm.request` span (when it has arrived) and its children."""
    trace_id: str
    spans: dict[str, Span] = field(default_factory=dict)

    @property
    def root(self) -> Span | None:
        for s in self.spans.values():
            if s.name == ROOT_SPAN or not s.parent_id:
                return s
        return None

    def attr(self, key: str, default: Any = None) -> Any:
        root = self.root
        return default if root is None else root.attributes.get(key, default)

    @property
    def start_ns(self) -> int:
        return min((s.start_ns for s in self.spans.values()), default=0)

    @property
    def end_ns(self) -> int:
        return max((s.end_ns for s in self.spans.values()), default=0)

    def ordered(self) -> list[Span]:
        """Root first, then children by start time (the waterfall's rows)."""
        root = self.root
        rest = sorted((s for s in self.spans.values() if s is not root),
                      key=lambda s: (s.start_ns, s.end_ns))
        return ([root] if root else []) + rest


def attribute_value(value: Any) -> Any:
    """One OTLP AnyValue ({"stringValue": ...}, {"intValue": "12"}, ...) as a Python value."""
    if not isinstance(value, dict):
        return None
    if "stringValue" in value:
        return str(value["stringValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [attribute_value(v) for v in value["arrayValue"].get("values", [])]
    return None


def parse_span(raw: dict[str, Any]) -> Span:
    """Raises (KeyError, TypeError, ValueError) on a span that is not OTLP-shaped."""
    attrs = {}
    for a in raw.get("attributes") or []:
        try:
            attrs[str(a["key"])] = attribute_value(a.get("value"))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # one bad attribute does not lose the span
    status = raw.get("status") or {}
    return Span(span_id=str(raw["spanId"]), parent_id=str(raw.get("parentSpanId") or ""),
                name=str(raw["name"]), start_ns=int(raw["startTimeUnixNano"]),
                end_ns=int(raw["endTimeUnixNano"]),
                attributes=attrs, status_code=int(status.get("code", 0) or 0))


def iter_raw_spans(frame: dict[str, Any]):
    """(traceId, raw span) for every span in a `spans` frame."""
    for rs in frame.get("resourceSpans") or []:
        for ss in rs.get("scopeSpans") or []:
            for sp in ss.get("spans") or []:
                yield str(sp["traceId"]), sp


class TraceBook:
    """The most recent `capacity` requests, oldest first, keyed by trace id."""

    def __init__(self, capacity: int = 200):
        self.capacity = capacity
        self.traces: OrderedDict[str, Trace] = OrderedDict()
        self.num_bad_spans = 0

    def add_frame(self, frame: dict[str, Any]) -> list[str]:
        """Fold a `spans` frame in; returns the trace ids it touched (in order, no repeats)."""
        touched: list[str] = []
        for trace_id, raw in iter_raw_spans(frame):
            try:
                span = parse_span(raw)
            except (KeyError, TypeError, ValueError, AttributeError):
                self.num_bad_spans += 1
                continue
            trace = self.traces.get(trace_id)
            if trace is None:
                trace = self.traces[trace_id] = Trace(trace_id)
            trace.spans[span.span_id] = span
            if trace_id not in touched:
                touched.append(trace_id)
        while len(self.traces) > self.capacity:
            self.traces.popitem(last=False)
        return touched

    def get(self, trace_id: str) -> Trace | None:
        return self.traces.get(trace_id)

    def __len__(self) -> int:
        return len(self.traces)
