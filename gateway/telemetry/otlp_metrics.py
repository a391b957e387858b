"""Pushes the gateway's Prometheus registry to an OTLP/HTTP collector as OTLP JSON metrics.

One instrumentation (the prometheus_client registry, whose vLLM-style names carry colons that
OpenTelemetry instrument names cannot) and three outlets: /metrics, the live feed, and this.
"""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

log = logging.getLogger(__name__)


def registry_to_otlp(registry, service_name: str = "inferstack-gateway") -> dict:
    now = str(int(time.time() * 1e9))
    metrics = []
    for family in registry.collect():
        points = [_point(s, now) for s in family.samples if _plain(family, s)]
        if family.type == "histogram":
            metrics.append({"name": family.name, "description": family.documentation,
                            "histogram": {"aggregationTemporality": 2,
                                          "dataPoints": _histograms(family, now)}})
        elif family.type == "counter":
            metrics.append({"name": family.name, "description": family.documentation,
                            "sum": {"aggregationTemporality": 2, "isMonotonic": True,
                                    "dataPoints": points}})
        else:
            metrics.append({"name": family.name, "description": family.documentation,
                            "gauge": {"dataPoints": points}})
    return {"resourceMetrics": [{
        "resource": {"attributes": [{"key": "service.name",
                                     "value": {"stringValue": service_name}}]},
        "scopeMetrics": [{"scope": {"name": "inferstack.gateway"}, "metrics": metrics}]}]}


def _plain(family, sample) -> bool:
    return not sample.name.endswith("_created") and (family.type != "counter" or
                                                     sample.name.endswith("_total"))


def _attrs(labels: dict) -> list[dict]:
    return [{"key": k, "value": {"stringValue": v}} for k, v in labels.items() if k != "le"]


def _point(sample, now: str) -> dict:
    return {"attributes": _attrs(sample.labels), "timeUnixNano": now, "asDouble": sample.value}


def _histograms(family, now: str) -> list[dict]:
    series: dict[tuple, dict] = {}
    for s in family.samples:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        h = series.setdefault(key, {"attributes": _attrs(dict(key)), "timeUnixNano": now,
                                    "bounds": [], "cumulative": [], "count": "0", "sum": 0.0})
        if s.name.endswith("_bucket"):
            h["bounds"].append(float(s.labels["le"]))
            h["cumulative"].append(s.value)
        elif s.name.endswith("_count"):
            h["count"] = str(int(s.value))
        elif s.name.endswith("_sum"):
            h["sum"] = s.value
    points = []
    for h in series.values():
        counts, previous = [], 0.0
        for c in h.pop("cumulative"):
            counts.append(str(int(c - previous)))
            previous = c
        bounds = [b for b in h.pop("bounds") if b != float("inf")]
        points.append({**h, "explicitBounds": bounds, "bucketCounts": counts})
    return points


async def push_loop(registry_source, endpoint: str, stop: asyncio.Event,
                    interval: float = 10.0) -> None:
    """POST the registry every `interval` seconds until `stop`; failures are logged once."""
    url = endpoint.rstrip("/") + "/v1/metrics"
    warned = False
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            registry = registry_source()
            if registry is not None:
                try:
                    async with session.post(url, json=registry_to_otlp(registry),
                                            timeout=aiohttp.ClientTimeout(total=5)) as r:
                        r.raise_for_status()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    if not warned:
                        log.warning("OTLP metrics push to %s failed: %s", url, exc)
                        warned = True
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass
