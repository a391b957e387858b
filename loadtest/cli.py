"""Command line: `python -m loadtest --url URL --workload NAME (--rate R | --concurrency C)
(--duration S | --requests N) [...]`, or `python -m loadtest --compare A.json B.json`."""
from __future__ import annotations

import argparse
import asyncio

import orjson

from loadtest.arrivals import KINDS as ARRIVALS
from loadtest.client import PROTOCOLS
from loadtest.day_profile import DEFAULT_CURVE, CurveError, DayProfile, read_curve
from loadtest.dists import Dist
from loadtest.mix import Mix, parse_priorities, parse_tenants
from loadtest.pricing import PRESETS, PriceBook
from loadtest.runner import LoadShape
from loadtest.session import Settings, run_load, with_rate
from loadtest.slo import SLO
from loadtest.stream import COUNT_MODES
from loadtest.workloads import WorkloadParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest",
                                description="Load-test an OpenAI-compatible server.")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print the differences between two results and exit")
    g = p.add_argument_group("target")
    g.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    g.add_argument("--api-key", help="bearer token (the default tenant's key)")
    g.add_argument("--model", help="model name (default: the first of /v1/models)")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    g.add_argument("--protocol", choices=PROTOCOLS, default="sse",
                   help="sse streaming, ws (our /v1/ws), or http (non-streaming)")
    g.add_argument("--count-tokens", choices=COUNT_MODES, default="usage",
                   help="tokens per stream message: the reported usage spread over the "
                        "messages (one each when a server reports none), logprob entries, "
                        "or one per message (chunks, an estimate)")
    g.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="random",
                   help="shared-prefix | chat | random | trace:FILE.jsonl")
    g.add_argument("--input-len", default="32", help="words: N or a distribution "
                   "(uniform:LO:HI, normal:MEAN:STD, exp:MEAN, lognormal:MEDIAN:SIGMA)")
    g.add_argument("--output-len", default="32", help="max_tokens: N or a distribution")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix report words")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix reports")
    g.add_argument("--users", type=int, default=16, help="chat conversations at once")
    g.add_argument("--turns", type=int, default=4, help="chat turns per conversation")
    g.add_argument("--tenants", help="NAME=KEY[:WEIGHT],... API keys and their weights")
    g.add_argument("--priorities", help="CLASS[:WEIGHT],... priority classes (sent as "
                   "the body's priority field; omitted when not given)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--rate", type=float, help="open loop: requests per second")
    g.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1: Poisson)")
    g.add_argument("--arrival-profile", choices=("flat", "day"), default="flat",
                   help="day: a Poisson rate that follows a day's curve between --rate-min "
                   "and --rate-max over --day-seconds")
    g.add_argument("--day-seconds", type=float, default=240.0,
                   help="seconds one compressed day lasts (--arrival-profile day)")
    g.add_argument("--rate-min", type=float, default=0.0,
                   help="requests per second at the curve's 0 (--arrival-profile day)")
    g.add_argument("--rate-max", type=float,
                   help="requests per second at the curve's 1 (--arrival-profile day)")
    g.add_argument("--day-curve", help="file of 'HOUR FRACTION' lines (default: a working "
                   "day's curve; --arrival-profile day)")
    g.add_argument("--concurrency", type=int, help="closed loop: users at once")
    g.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    g.add_argument("--duration", type=float, help="seconds of sending")
    g.add_argument("--requests", type=int, help="requests to send")
    g.add_argument("--warmup", type=float, default=0.0, help="seconds excluded at the start")
    g.add_argument("--warmup-requests", type=int, default=0,
                   help="the first K requests are excluded too")
    g.add_argument("--cooldown", type=float, default=0.0, help="seconds excluded at the end")
    g.add_argument("--grace", type=float, default=60.0,
                   help="seconds in-flight requests may finish after sending stops")
    g.add_argument("--time-scale", type=float, default=1.0, help="trace timestamp multiplier")
    g.add_argument("--sweep", action="store_true",
                   help="find the highest rate meeting --slo (starts at --rate)")
    g.add_argument("--slo-target", type=float, default=0.99,
                   help="share of requests that must meet the SLO in a sweep")
    g = p.add_argument_group("figures and output")
    g.add_argument("--slo", help="ttft:MS,tpot:MS,itl:MS,e2e:MS")
    g.add_argument("--price-book", choices=tuple(PRESETS), default="seed")
    g.add_argument("--ignore-reported-cost", action="store_true",
                   help="price every request with --price-book, even where usage.cost exists")
    g.add_argument("--gpus", type=float, default=1.0)
    g.add_argument("--gpu-cost-per-hour", type=float, default=2.0)
    g.add_argument("--out", help="write the JSON result here")
    g.add_argument("--save-requests", action="store_true", help="per-request records in JSON")
    g.add_argument("--charts", help="folder for PNG charts")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return p


def day_profile(args: argparse.Namespace) -> DayProfile | None:
    """The day-shaped rate of --arrival-profile day (it stands for --rate), or None."""
    if args.arrival_profile != "day":
        if args.day_curve or args.rate_max is not None:
            raise SystemExit("--day-curve and --rate-max need --arrival-profile day")
        return None
    if args.rate is not None or args.concurrency is not None:
        raise SystemExit("--arrival-profile day sets the rate: give --rate-min and "
                         "--rate-max, not --rate or --concurrency")
    if args.rate_max is None:
        raise SystemExit("--arrival-profile day needs --rate-max")
    if args.arrival != "poisson":
        raise SystemExit("--arrival-profile day draws Poisson arrivals: leave --arrival out")
    try:
        points = read_curve(args.day_curve) if args.day_curve else DEFAULT_CURVE
        return DayProfile(args.rate_min, args.rate_max, args.day_seconds, points)
    except CurveError as exc:
        raise SystemExit(f"--day-curve: {exc}") from None


def settings_from(args: argparse.Namespace) -> Settings:
    if not args.url:
        raise SystemExit("--url is required")
    day = day_profile(args)
    if day is not None:
        args.rate = day.rate_max  # open loop; the profile thins it
    if (args.rate is None) == (args.concurrency is None) and not args.workload.startswith(
            "trace:"):
        raise SystemExit("give exactly one of --rate or --concurrency")
    trace = args.workload.startswith("trace:")
    if (args.duration is None) == (args.requests is None) and not (
            trace and args.duration is None and args.requests is None):
        raise SystemExit("give exactly one of --duration or --requests")
    shape = LoadShape(rate=args.rate, arrival=args.arrival, burstiness=args.burstiness,
                      concurrency=args.concurrency, max_concurrency=args.max_concurrency,
                      duration=args.duration, requests=args.requests, warmup=args.warmup,
                      warmup_requests=args.warmup_requests,
                      cooldown=args.cooldown, grace=args.grace, time_scale=args.time_scale,
                      day=day)
    params = WorkloadParams(Dist.parse(args.input_len), Dist.parse(args.output_len),
                            args.prefix_len, args.num_prefixes, args.users, args.turns)
    mix = Mix(parse_tenants(args.tenants, args.api_key), parse_priorities(args.priorities))
    return Settings(args.url, args.workload, shape, params, mix, args.api_key, args.model,
                    args.endpoint, args.protocol, args.count_tokens,
                    orjson.loads(args.extra_body), args.timeout, args.seed, SLO.parse(args.slo),
                    PriceBook.preset(args.price_book, not args.ignore_reported_cost),
                    args.gpus, args.gpu_cost_per_hour, args.save_requests)


async def run_cli(args: argparse.Namespace) -> dict:
    st = settings_from(args)
    if not args.sweep:
        result, out = await run_load(st, progress=not args.no_progress)
        if args.charts:
            from loadtest.charts import write_charts
            write_charts(out.records, result, args.charts)
        return result
    if st.shape.rate is None or st.slo.is_empty():
        raise SystemExit("--sweep needs --rate (the starting rate) and --slo")
    from loadtest.sweep import find_max_rate
    last: dict = {}

    async def trial(rate: float) -> dict:
        last["result"], _ = await run_load(with_rate(st, rate), progress=False)
        return last["result"]
    sweep = await find_max_rate(trial, st.shape.rate, args.slo_target)
    best = sweep["best_rate"]
    result = (await run_load(with_rate(st, best), False))[0] if best else last["result"]
    result["sweep"] = sweep
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from loadtest.report import print_report
    if args.compare:
        from loadtest.compare import print_compare
        print_compare(*args.compare)
        return 0
    try:
        import uvloop
        result = uvloop.run(run_cli(args))
    except ImportError:
        result = asyncio.run(run_cli(args))
    print_report(result)
    if "sweep" in result:
        from rich.console import Console
        Console().print(f"sweep: best rate {result['sweep']['best_rate']} req/s at SLO "
                        f"attainment >= {result['sweep']['target']}")
    if args.out:
        from loadtest.result import write_result
        write_result(result, args.out)
    failed = result["summary"]["requests"]["failed"]
    return 0 if result["summary"]["requests"]["completed"] or not failed else 1
