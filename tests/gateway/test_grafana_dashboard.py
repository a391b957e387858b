"""The Grafana dashboard that ships in dashboards/grafana: its shape, every metric its PromQL
reads present in a fake-engine gateway's /metrics after traffic, and every query accepted by a
real Prometheus scraping that gateway, the core panels with data."""
from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metrics import GatewayMetrics
from testkit.services.prometheus import scraped_gateway
from tests.gateway.keyfile import write_key_file

DASHBOARD = Path(__file__).parents[2] / "dashboards" / "grafana" / "inferstack.json"
METRICS_KEY = "sk-scraper"
TENANTS: dict[str, dict] = {"alpha": {}, "beta": {}, "ops": {}}
KEYS = [("sk-alpha", "alpha", False, False), ("sk-beta", "beta", False, False),
        (METRICS_KEY, "ops", False, False, True)]
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval is with a 15 s scrape interval
# series that exist only once a request has finished (the histograms and counters carry a
# model_name label and appear on their first observation); the ITL one on the first stream
AFTER_FIRST_REQUEST = {
    "vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "inferstack:cached_prompt_tokens_total", "inferstack:revenue_usd_total"}
# the fake engine reports no prefix-cache queries, so hits / queries is 0 / 0 there
NAN_ON_FAKE_ENGINE = ("vllm:prefix_cache_hits_total",)


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def targets(dashboard: dict) -> list[tuple[str, dict]]:
    """(panel title, target) for every query of every panel."""
    return [(p["title"], t) for p in dashboard["panels"] for t in p.get("targets", [])]


# ---- a small PromQL tokenizer -----------------------------------------------------------------
TOKEN = re.compile(r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])                       # [5m], [$__rate_interval], [1h:1m]
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+\b)     # after offset
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<other>\S)
""", re.VERBOSE)
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"} | AGGREGATIONS


def tokens(expr: str) -> list[tuple[str, str]]:
    return [(m.lastgroup, m.group()) for m in TOKEN.finditer(expr)]


def queried_metrics(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers outside braces and strings that are
    not functions (followed by `(`), keywords, aggregations or grouping label lists; inside
    braces only a `__name__` matcher names one."""
    toks, found, braces, i = tokens(expr), set(), 0, 0
    while i < len(toks):
        kind, text = toks[i]
        following = toks[i + 1][1] if i + 1 < len(toks) else ""
        if text in "{}" and kind == "other":
            braces += 1 if text == "{" else -1
        elif braces and text == "__name__" and toks[i + 2][0] == "string":
            found.add(toks[i + 2][1][1:-1])
        elif not braces and kind == "ident":
            if text in LABEL_LISTS and following == "(":
                i = toks.index((("other", ")")), i)  # label names, not metrics
            elif following != "(" and text.lower() not in KEYWORDS | LABEL_LISTS:
                found.add(text)
        i += 1
    return found


@pytest.mark.parametrize("expr, expected", [
    ('sum by (le) (rate(a_bucket{x="sum(b)"}[5m]))', {"a_bucket"}),
    ("histogram_quantile(0.9, sum(rate(h_bucket[$__rate_interval])) by (le, job))",
     {"h_bucket"}),
    ("x * 3600 / scalar(sum(n:workers))", {"x", "n:workers"}),
    ("a / on(job) group_left(tenant) b offset 5m", {"a", "b"}),
    ('{__name__="vllm:x", le="1"} > bool 2 and up', {"vllm:x", "up"}),
    ("max without (worker) (vllm:kv_cache_usage_perc) unless count(c) by (d)",
     {"vllm:kv_cache_usage_perc", "c"}),
])
def test_queried_metrics(expr, expected):
    assert queried_metrics(expr) == expected


# ---- the dashboard's shape --------------------------------------------------------------------
def test_dashboard_is_an_importable_grafana_dashboard():
    d = load_dashboard()
    assert 36 <= d["schemaVersion"] <= 41 and d["uid"] and d["title"]
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)) and refs, p["title"]
    titles = " | ".join(p["title"] for p in d["panels"]).lower()
    for subject in ("finish reason", "running and waiting", "time to first token",
                    "inter-token", "kv cache", "hit rate", "per gpu-hour by tenant",
                    "revenue by kind"):
        assert subject in titles


def test_every_target_queries_known_metrics():
    for title, t in targets(load_dashboard()):
        assert queried_metrics(t["expr"]), f"{title}: no metric in {t['expr']}"


# ---- against a gateway and a real Prometheus --------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grafana")
    keys = write_key_file(tmp / "keys.toml", TENANTS, KEYS)
    with scraped_gateway(tmp, METRICS_KEY, "--fake", "--fake-step-ms", "5", "--keys-file",
                         keys, "--ledger-path", str(tmp / "ledger.sqlite3")) as pair:
        yield pair


def exposed(gw) -> set[str]:
    """Every sample name in the gateway's /metrics (`_bucket`, `_total`... as exposed)."""
    text = gw.get("/metrics", METRICS_KEY)[1].decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


async def one_wave(gw) -> None:
    """Both tenants, streamed and not, ending on length and on a stop string, and a repeated
    long prompt so that some prompt tokens are cache hits."""
    prompt = " ".join(f"word{i}" for i in range(60))

    async def send(session, key, body):
        async with session.post(gw.url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200, await r.text()
            await r.read()
    bodies = [{"prompt": prompt, "max_tokens": 8, "stream": True},
              {"prompt": prompt, "max_tokens": 8},
              {"prompt": "short", "max_tokens": 20, "stop": [" fox"], "stream": True}]
    async with aiohttp.ClientSession() as s:
        for key in ("sk-alpha", "sk-beta"):
            for body in bodies:
                await send(s, key, body)


@pytest.fixture(scope="module")
def traffic(stack):
    """Two waves with a scrape after each, so every rate window holds two samples that
    differ; returns the sample names exposed before any request."""
    gw, prom = stack
    before = exposed(gw)
    for _ in range(2):
        asyncio.run(one_wave(gw))
        time.sleep(0.5)  # the last settlements land just after the responses
        prom.api.wait_for_scrape(after=time.time())
    return before


def test_every_dashboard_metric_is_exposed_after_traffic(stack, traffic):
    gw, _ = stack
    wanted = {m for _, t in targets(load_dashboard()) for m in queried_metrics(t["expr"])}
    variable = load_dashboard()["templating"]["list"][0]["definition"]
    wanted |= set(re.findall(r"label_values\(([^,)]+)", variable))
    now = exposed(gw)
    assert wanted - now == set()
    assert wanted - traffic == AFTER_FIRST_REQUEST  # the rest exist from the first worker on


def substituted(expr: str, model: str) -> str:
    """Grafana's variables as Grafana would fill them for one model and a 15 s scrape."""
    escaped = re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", model).replace("\\", "\\\\")
    out = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model_name", escaped)
    assert "$" not in out, out
    return out


@pytest.fixture(scope="module")
def model(stack, traffic):
    """The model_name variable's values, from Prometheus as Grafana's label_values reads."""
    values = stack[1].api.call("/api/v1/label/model_name/values")["data"]
    assert len(values) == 1, values
    return values[0]


@pytest.mark.parametrize("title, target", targets(load_dashboard()),
                         ids=[f"{p}-{t['refId']}" for p, t in targets(load_dashboard())])
def test_every_query_runs_and_has_data(stack, model, title, target):
    prom = stack[1]
    answer = prom.api.query(substituted(target["expr"], model))
    assert answer["status"] == "success", answer
    samples = prom.api.vector(substituted(target["expr"], model))
    assert samples, f"{title}: no data for {target['expr']}"
    if not any(name in target["expr"] for name in NAN_ON_FAKE_ENGINE):
        assert all(math.isfinite(v) for _, v in samples), samples


@pytest.mark.parametrize("legend, label, values", [
    ("{{tenant}}", "tenant", {"alpha", "beta"}),
    ("{{kind}}", "kind", {"cache_hit_input", "cache_miss_input", "output"})])
def test_revenue_splits_by_tenant_and_kind(stack, model, legend, label, values):
    (expr,) = [t["expr"] for title, t in targets(load_dashboard())
               if "revenue" in title.lower() and t["legendFormat"] == legend]
    samples = stack[1].api.vector(substituted(expr, model))
    assert {s[label] for s, _ in samples} == values
    assert all(v > 0 for _, v in samples), samples


def test_gpu_hours_count_every_worker_alive_or_not():
    """The revenue-per-GPU-hour divisor: a GPU costs the same while its worker restarts."""
    metrics = GatewayMetrics("m")
    workers = [SimpleNamespace(index=i, alive=alive, restarts=0, num_inflight=0, stats={})
               for i, alive in enumerate((True, False, True))]
    metrics.refresh(0, workers)
    values = {s.name: s.value for fam in text_string_to_metric_families(metrics.render().decode())
              for s in fam.samples}
    assert values["inferstack:workers"] == 3 and values["inferstack:workers_alive"] == 2
