"""From measured records to the figures: latency distributions, throughput, goodput, errors,
cache-hit rate, money and the usage check, for one group of requests.

duration: from the first measured send to the last measured end (seconds); every rate is
  a count over that duration.
latency_ms: ttft, itl (every per-token gap of every successful streamed request), tpot (one
  value per request), chunk_gap (every gap between token messages, one per arrival however
  many tokens it carries), e2e (from send), e2e_from_intended (from the schedule's time, so a
  backed-up client cannot hide queueing), schedule_lag (sent - intended).
tokens: completion counts the server's usage where it reports one, else the messages (one
  each); counted_from says how many requests were counted which way (record.count_source).
goodput: successful requests meeting every SLO limit, per second; slo_attainment: their share
  of all measured requests.
cache.hit_rate: sum(cached_tokens) / sum(prompt_tokens) over successful requests.
money: each request's reported usage.cost or its price-book price; revenue per hour =
  total / duration * 3600; per GPU-hour = per hour / gpus; gpu_cost_per_hour = gpus * price.
"""
from __future__ import annotations

import math
from collections import Counter

from loadtest.pricing import PriceBook, request_cost
from loadtest.record import RequestRecord
from loadtest.slo import SLO
from loadtest.stats import summarize
from numeric.percentiles import percentile

MS = 1000.0


def figures(records: list[RequestRecord], slo: SLO, book: PriceBook, gpus: float = 1.0,
            gpu_cost_per_hour: float = 0.0) -> dict:
    ok = [r for r in records if r.ok]
    sent = [r for r in records if r.was_sent]
    duration = _duration(sent)
    good = [r for r in ok if slo.met_by(r)]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out_tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": {"total": len(records), "completed": len(ok),
                     "failed": len(records) - len(ok), "good": len(good),
                     "errors": dict(Counter(r.error for r in records if not r.ok)),
                     "status": {str(k): v for k, v in
                                Counter(r.status for r in records if r.status).items()}},
        "duration_s": duration,
        "throughput": {"requests_per_s": per_s(len(ok)),
                       "output_tokens_per_s": per_s(out_tokens),
                       "input_tokens_per_s": per_s(sum(r.prompt_tokens for r in ok)),
                       "goodput_requests_per_s": per_s(len(good)),
                       "goodput_output_tokens_per_s": per_s(
                           sum(r.completion_tokens for r in good)),
                       "slo_attainment": len(good) / len(records) if records else None},
        "latency_ms": latency(ok, sent),
        "tokens": tokens(ok),
        "cache": cache(ok),
        "money": money(ok, book, duration, gpus, gpu_cost_per_hour),
    }


def _duration(sent: list[RequestRecord]) -> float:
    if not sent:
        return 0.0
    return max(r.end for r in sent) - min(r.sent for r in sent)


def latency(ok: list[RequestRecord], sent: list[RequestRecord]) -> dict:
    streamed = [r for r in ok if r.streamed]
    return {
        "ttft": summarize([r.ttft for r in ok if r.ttft is not None], MS),
        "itl": summarize([g for r in streamed for g in r.itls()], MS),
        "tpot": summarize([r.tpot for r in streamed if r.tpot is not None
                           and r.tokens_arrived > 1], MS),
        "chunk_gap": summarize([g for r in streamed for g in r.chunk_gaps()], MS),
        "e2e": summarize([r.e2e for r in ok], MS),
        "e2e_from_intended": summarize([r.e2e_intended for r in ok], MS),
        "schedule_lag": summarize([r.schedule_lag for r in sent], MS),
    }


def tokens(ok: list[RequestRecord]) -> dict:
    with_usage = [r for r in ok if r.usage and r.usage.get("completion_tokens") is not None]
    return {"prompt": sum(r.prompt_tokens for r in ok),
            "cached": sum(r.cached_tokens for r in ok),
            "completion": sum(r.completion_tokens for r in ok),
            "completion_reported": sum(int(r.usage["completion_tokens"]) for r in with_usage),
            "completion_arrived": sum(r.tokens_arrived for r in with_usage),
            "messages": sum(len(r.chunks) for r in ok),
            "counted_from": dict(Counter(r.count_source for r in ok)),
            "requests_without_usage": len(ok) - len(with_usage),
            "usage_mismatch_requests": sum(1 for r in ok if r.usage_mismatch)}


def cache(ok: list[RequestRecord]) -> dict:
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    hits = sum(1 for r in ok if r.cached_tokens > 0)
    return {"hit_rate": cached / prompt if prompt else None,
            "requests_with_hits": hits,
            "request_hit_fraction": hits / len(ok) if ok else None}


def money(ok: list[RequestRecord], book: PriceBook, duration: float, gpus: float,
          gpu_cost_per_hour: float) -> dict:
    parts = {"cache_hit_input": 0.0, "cache_miss_input": 0.0, "output": 0.0, "total": 0.0}
    sources: Counter = Counter()
    for r in ok:
        r.cost, r.cost_source = request_cost(r.usage, book, book.use_reported)
        sources[r.cost_source] += 1
        for k in parts:
            parts[k] += (r.cost or {}).get(k, 0.0)
    hours = duration / 3600.0
    per_hour = parts["total"] / hours if hours > 0 else 0.0
    per_gpu_hour = per_hour / gpus if gpus else math.nan
    return {"price_book": book.name, "sources": dict(sources), "revenue": parts,
            "revenue_per_hour": per_hour, "revenue_per_gpu_hour": per_gpu_hour,
            "gpus": gpus, "gpu_cost_per_hour": gpus * gpu_cost_per_hour,
            "margin_per_gpu_hour": per_gpu_hour - gpu_cost_per_hour,
            "revenue_per_request": parts["total"] / len(ok) if ok else None}


def grouped(records: list[RequestRecord], key, slo: SLO, book: PriceBook, gpus: float,
            gpu_cost_per_hour: float) -> dict:
    """figures() for each value of key(record), keys as strings ("none" for None)."""
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault("none" if key(r) is None else str(key(r)), []).append(r)
    return {k: figures(v, slo, book, gpus, gpu_cost_per_hour) for k, v in sorted(groups.items())}


def timeseries(records: list[RequestRecord], bucket: float = 1.0) -> dict:
    """Per `bucket` seconds of the whole run (warm-up included): requests finished, output
    tokens arrived, requests in flight at the bucket's end, median TTFT and e2e of requests
    that finished in it, errors."""
    end = max((r.end for r in records), default=0.0)
    n = int(end // bucket) + 1
    done, toks, errs = [0] * n, [0] * n, [0] * n
    ttft: list[list] = [[] for _ in range(n)]
    e2e: list[list] = [[] for _ in range(n)]
    for r in records:
        i = min(n - 1, int(r.end // bucket))
        done[i] += 1
        errs[i] += 0 if r.ok else 1
        if r.ok:
            e2e[i].append(r.e2e * MS)
            if r.ttft is not None:
                ttft[i].append(r.ttft * MS)
        for t, k in r.chunks:
            toks[min(n - 1, int(t // bucket))] += k
    in_flight = [sum(1 for r in records if r.was_sent and r.sent <= (i + 1) * bucket < r.end)
                 for i in range(n)] if len(records) * n <= 5_000_000 else []  # else too slow
    return {"bucket_s": bucket, "t": [i * bucket for i in range(n)], "finished": done,
            "output_tokens": toks, "errors": errs, "in_flight": in_flight,
            "ttft_p50_ms": [_median(x) for x in ttft], "e2e_p50_ms": [_median(x) for x in e2e]}


def _median(xs: list[float]) -> float | None:
    return percentile(xs, 50) if xs else None  # None, not NaN: it goes into JSON
