"""The JSON result: one document per run, schema "inferstack.loadtest/1" (docs/loadtest.md).

{"schema", "run": {settings}, "summary": figures of all measured requests,
 "by_priority": {class: figures}, "by_tenant": {name: figures},
 "client": {"loop_lag_ms", "max_in_flight", "requests_excluded_warmup", "wall_s"},
 "timeseries": per-second series of the whole run, "requests": per-request records (optional)}
"""
from __future__ import annotations

import datetime as dt

import orjson

from loadtest.figures import figures, grouped, timeseries
from loadtest.pricing import PriceBook
from loadtest.runner import RunOutput
from loadtest.slo import SLO
from loadtest.stats import summarize

SCHEMA = "inferstack.loadtest/1"


def build_result(out: RunOutput, run: dict, slo: SLO, book: PriceBook, gpus: float = 1.0,
                 gpu_cost_per_hour: float = 0.0, save_requests: bool = False) -> dict:
    measured = [r for r in out.records if not r.warmup]
    money = (slo, book, gpus, gpu_cost_per_hour)
    result = {
        "schema": SCHEMA,
        "run": {**run, "finished_at": dt.datetime.now(dt.UTC).isoformat(),
                "slo": slo.as_dict(), "price_book": book.name, "gpus": gpus,
                "gpu_cost_per_hour": gpu_cost_per_hour},
        "summary": figures(measured, *money),
        "by_priority": grouped(measured, lambda r: r.priority, *money),
        "by_tenant": grouped(measured, lambda r: r.tenant, *money),
        "client": {"loop_lag_ms": summarize(out.loop_lag, 1000.0),
                   "loop_lag_ms_whole_run": summarize(out.loop_lag_all, 1000.0),
                   "max_in_flight": out.max_in_flight,
                   "requests_excluded_warmup": len(out.records) - len(measured),
                   "send_end_s": out.send_end, "wall_s": out.wall},
        "timeseries": timeseries(out.records),
    }
    if save_requests:
        result["requests"] = [r.as_json() for r in out.records]
    return result


def write_result(result: dict, path: str) -> None:
    with open(path, "wb") as fh:
        fh.write(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def read_result(path: str) -> dict:
    with open(path, "rb") as fh:
        result = orjson.loads(fh.read())
    if result.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a {SCHEMA} result")
    return result
