"""One complete run from settings: find the model, build the workload, drive the load, and
turn the records into a result document."""
from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from dataclasses import dataclass, field

import aiohttp

from loadtest.client import Client
from loadtest.mix import Mix
from loadtest.pricing import PriceBook
from loadtest.result import build_result
from loadtest.runner import LoadShape, Runner, RunOutput
from loadtest.slo import SLO
from loadtest.workloads import WorkloadParams, make_workload


@dataclass(frozen=True)
class Settings:
    url: str
    workload: str
    shape: LoadShape
    params: WorkloadParams = WorkloadParams()
    mix: Mix = field(default_factory=lambda: Mix.default())
    api_key: str | None = None
    model: str | None = None
    endpoint: str = "chat"
    protocol: str = "sse"
    count_mode: str = "usage"
    extra_body: dict = field(default_factory=dict)
    timeout: float = 600.0
    seed: int = 0
    slo: SLO = SLO()
    book: PriceBook = PriceBook.preset("seed")
    gpus: float = 1.0
    gpu_cost_per_hour: float = 0.0
    save_requests: bool = False


async def find_model(url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models, else "default"."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(url.rstrip("/") + "/v1/models", headers=headers) as r:
                data = (await r.json()).get("data") or []
                return data[0]["id"] if data else "default"
    except (TimeoutError, aiohttp.ClientError, KeyError, TypeError, ValueError):
        return "default"


def run_info(st: Settings, model: str) -> dict:
    p = st.params
    return {"url": st.url, "model": model, "workload": st.workload, "protocol": st.protocol,
            "endpoint": st.endpoint, "count_tokens": st.count_mode, "seed": st.seed,
            "load": st.shape.as_dict(),
            "workload_params": {"input_len": str(p.input_len), "output_len": str(p.output_len),
                                "prefix_len": p.prefix_len, "num_prefixes": p.num_prefixes,
                                "users": p.users, "turns": p.turns},
            "tenants": [t.name for t in st.mix.tenants],
            "priorities": [c for c, _ in st.mix.priorities],
            "started_at": dt.datetime.now(dt.UTC).isoformat()}


async def run_load(st: Settings, progress: bool = False) -> tuple[dict, RunOutput]:
    model = st.model or await find_model(st.url, st.api_key)
    specs = make_workload(st.workload, st.params, st.mix, st.seed, st.api_key)
    info = run_info(st, model)
    async with Client(st.url, model, endpoint=st.endpoint, protocol=st.protocol,
                      count_mode=st.count_mode, extra_body=st.extra_body,
                      timeout=st.timeout) as client:
        runner = Runner(client, specs, st.shape, st.seed, st.workload)
        shower = None
        if progress:
            from loadtest.progress import show_progress
            by_time = st.shape.duration is not None
            total = st.shape.duration if by_time else float(st.shape.requests or 1)

            def start() -> None:
                nonlocal shower
                shower = asyncio.create_task(show_progress(runner, total, by_time))
            out = await runner.run(on_start=start)
            shower.cancel()
            await asyncio.gather(shower, return_exceptions=True)
        else:
            out = await runner.run()
    result = build_result(out, info, st.slo, st.book, st.gpus, st.gpu_cost_per_hour,
                          st.save_requests)
    return result, out


def with_rate(st: Settings, rate: float) -> Settings:
    return dataclasses.replace(st, shape=dataclasses.replace(st.shape, rate=rate))
