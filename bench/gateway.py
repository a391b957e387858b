"""The gateway's streaming overhead: the gateway with its fake engine against a bare aiohttp
SSE server that streams the same chunks at the same cadence, side by side in one run.

    python bench/gateway.py                       # 64, 256 and 1,024 concurrent streams
    python bench/gateway.py --quick               # 64 and 256 streams, fewer tokens
    python bench/gateway.py --steady 10           # steady load instead of one burst

Both servers run in their own processes; the client (this process, uvloop + aiohttp) runs in a
third. The fake engine sleeps --step-ms per step and then emits one token to every running
request; the bare server has one asyncio task doing the same (snapshot the open streams, sleep
--step-ms, emit the next token to each as the same OpenAI completion chunk), so what differs is
only the gateway's machinery: queue, dispatch, worker process, frames, detokenization, SSE.

By default each level is one burst: every stream is sent at the same moment, the worst case
for time to first token (the last request of the burst waits for every one before it to be
parsed, authenticated, tokenized and queued). `--steady` measures what a serving system sees
in steady state: the same number of concurrent streams, started at random moments and each
replaced as it ends.

Per stream the client records time to first token (request sent on an already open connection
to the first content event), every inter-token gap, and the token count. Reported per system:
streamed tokens/s (all tokens / wall time of the whole batch), TTFT and inter-token-latency
p50/p99, the gateway's throughput as a ratio of the bare server's, the added latency (gateway
minus bare at the same percentile), and the CPU seconds of the client and of each server (on a
2-core machine the client itself can be the bottleneck at 1,024 streams: its CPU share shows it).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# The fake engine's token cycle (runtime/fake_engine.py WORDS, as the SmolLM2 tokenizer splits it).
WORDS = [" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", " and",
         " keeps", " running", " through", " the", " field", "."]
MODEL = "fake-smollm2"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "Connection": "keep-alive", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


# ---- the bare reference server ------------------------------------------------------------
class _BareStream:
    __slots__ = ("id", "created", "max_tokens", "sent", "queue")

    def __init__(self, max_tokens: int):
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.max_tokens = max_tokens
        self.sent = 0
        self.queue: asyncio.Queue = asyncio.Queue()


def serve_bare(port: int, step_ms: float) -> None:
    """A minimal OpenAI-style completion SSE server with the fake engine's batch-step cadence."""
    import orjson
    import uvloop
    from aiohttp import web

    step = step_ms / 1000.0
    streams: dict[int, _BareStream] = {}
    wake = asyncio.Event()

    def event(s: _BareStream, text: str, finish: str | None) -> bytes:
        return b"data: " + orjson.dumps(
            {"id": s.id, "object": "text_completion", "created": s.created, "model": MODEL,
             "choices": [{"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish}]}) + b"\n\n"

    async def ticker() -> None:
        while True:
            if not streams:
                wake.clear()
                await wake.wait()
            batch = list(streams.values())  # the requests "running" in this step
            await asyncio.sleep(step)
            for s in batch:
                s.queue.put_nowait(event(s, WORDS[s.sent % len(WORDS)], None))
                s.sent += 1
                if s.sent >= s.max_tokens:
                    s.queue.put_nowait(event(s, "", "length"))
                    s.queue.put_nowait(DONE)
                    s.queue.put_nowait(None)
                    streams.pop(id(s), None)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        s = _BareStream(int(body.get("max_tokens") or 16))
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, "x-request-id": s.id})
        await response.prepare(request)
        streams[id(s)] = s
        wake.set()
        try:
            while (data := await s.queue.get()) is not None:
                await response.write(data)
        finally:
            streams.pop(id(s), None)
        return response

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ready")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/ready", ready)
        # the same runner and site settings as gateway/__main__.py
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        task = asyncio.create_task(ticker())
        try:
            await asyncio.Event().wait()
        finally:
            task.cancel()
            await runner.cleanup()

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        pass


# ---- server processes -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started in its own session; waits for GET /ready == 200."""

    def __init__(self, name: str, argv: list[str], port: int, ready_timeout: float = 240.0):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        log = None if os.environ.get("BENCH_GATEWAY_LOG") else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=log,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True)
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.name} did not become ready")

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server's process tree (Linux /proc)."""
        tick = os.sysconf("SC_CLK_TCK")
        total, todo, seen = 0.0, [self.proc.pid], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        todo += [int(c) for c in f.read().split()]
            except (OSError, IndexError, ValueError):
                pass
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass


# ---- the client -----------------------------------------------------------------------------
async def _one_stream(session, url: str, tokens: int, stats: dict) -> dict:
    import orjson
    body = orjson.dumps({"prompt": "x", "max_tokens": tokens, "stream": True})
    times: list[float] = []
    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                stats["errors"] += 1
                return {"t0": t0, "times": [], "text": "", "status": resp.status}
            queued = resp.headers.get("x-queue-seconds")  # the gateway's own queue time
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    break
                now = time.perf_counter()
                piece = orjson.loads(line[6:])["choices"][0]["text"]
                if piece:
                    times.append(now)
                    text.append(piece)
    except Exception as e:  # noqa: BLE001 - a failed stream is counted, not fatal
        stats["errors"] += 1
        return {"t0": t0, "times": times, "text": "".join(text), "status": repr(e)}
    return {"t0": t0, "times": times, "text": "".join(text), "status": 200,
            "queued": None if queued is None else float(queued)}


async def _prewarm(session, url: str, n: int) -> None:
    """Open n keep-alive connections (n concurrent GETs) so the timed requests start on open
    connections: a burst of 1,024 connects into a 128-entry listen backlog would otherwise put
    SYN retransmits (1 s) into both systems' TTFT and hide the machinery being measured."""
    async def get():
        async with session.get(url + "/ready") as r:
            await r.read()
    await asyncio.gather(*(get() for _ in range(n)))


async def _run_load(url: str, concurrency: int, tokens: int, prewarm: bool,
                    steady: tuple[float, float] | None = None) -> dict:
    """All streams at once (a burst), or with `steady` = (ramp s, window s): each of the
    `concurrency` clients starts at a random moment of the ramp and then runs one stream
    after another; only streams started inside the window after the ramp count."""
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)
    stats = {"errors": 0}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if prewarm:
            await _prewarm(session, url, concurrency)
        cpu0, t0 = time.process_time(), time.perf_counter()
        if steady is None:
            results = await asyncio.gather(*(_one_stream(session, url, tokens, stats)
                                             for _ in range(concurrency)))
        else:
            results = await _steady(session, url, concurrency, tokens, stats, t0, *steady)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        if steady is not None:
            wall -= steady[0]  # tokens/s over the window: only streams started in it count
    return {"results": results, "wall": wall, "client_cpu": cpu, "errors": stats["errors"]}


async def _steady(session, url: str, concurrency: int, tokens: int, stats: dict, t0: float,
                  ramp: float, window: float) -> list[dict]:
    import random
    rng = random.Random(0)

    async def client(delay: float) -> list[dict]:
        await asyncio.sleep(delay)
        done = []
        while time.perf_counter() - t0 < ramp + window:
            done.append(await _one_stream(session, url, tokens, stats))
        return done
    runs = await asyncio.gather(*(client(rng.uniform(0, ramp)) for _ in range(concurrency)))
    return [r for run in runs for r in run if r["t0"] - t0 >= ramp]


def measure(server: ServerProcess, concurrency: int, tokens: int, prewarm: bool,
            steady: tuple[float, float] | None = None) -> dict:
    import uvloop

    from bench.common import percentile
    srv_cpu0 = server.cpu_seconds()
    run = uvloop.run(_run_load(server.url, concurrency, tokens, prewarm, steady))
    srv_cpu = server.cpu_seconds() - srv_cpu0
    ttft, itl, total, short = [], [], 0, 0
    texts = set()
    queued = [r["queued"] for r in run["results"] if r.get("queued") is not None]
    for r in run["results"]:
        ts = r["times"]
        total += len(ts)
        short += len(ts) < tokens
        if ts:
            ttft.append(ts[0] - r["t0"])
            itl += [b - a for a, b in zip(ts, ts[1:])]
            texts.add(r["text"])
    ms = 1000.0
    wall = run["wall"]
    return {
        "system": server.name, "concurrency": concurrency, "tokens_per_stream": tokens,
        "streams_ok": len(run["results"]) - run["errors"], "errors": run["errors"],
        "short_streams": short, "tokens": total, "wall_s": wall,
        "tokens_per_s": total / wall if wall > 0 else float("nan"),
        "ttft_p50_ms": percentile(ttft, 50) * ms, "ttft_p99_ms": percentile(ttft, 99) * ms,
        "ttft_max_ms": max(ttft) * ms if ttft else float("nan"),
        "itl_p50_ms": percentile(itl, 50) * ms, "itl_p99_ms": percentile(itl, 99) * ms,
        "gateway_queue_p99_ms": percentile(queued, 99) * ms if queued else None,
        "client_cpu_s": run["client_cpu"], "client_cpu_share": run["client_cpu"] / wall,
        "server_cpu_s": srv_cpu, "server_cpu_share": srv_cpu / wall,
        "distinct_texts": sorted(texts)[:2],
    }


# ---- main -------------------------------------------------------------------------------------
def _raise_fd_limit() -> None:
    """1,024 streams need more than a 1,024-descriptor soft limit; children inherit this."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="64,256,1024",
                   help="comma-separated concurrent stream counts")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=20.0, help="engine step time (both systems)")
    p.add_argument("--quick", action="store_true", help="64 and 256 streams, 32 tokens")
    p.add_argument("--no-prewarm", action="store_true",
                   help="connect inside the timed window (TTFT then includes TCP connect)")
    p.add_argument("--steady", type=float, default=0.0, metavar="SECONDS",
                   help="steady load instead of one burst: clients start at random over one "
                        "stream's length, then each runs stream after stream; TTFT and ITL "
                        "of the streams started in the next SECONDS")
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/gateway.json"))
    p.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.serve_bare:
        serve_bare(args.serve_bare, args.step_ms)
        return 0

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from bench.common import fmt, log, machine_info, markdown_table, write_json

    _raise_fd_limit()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    tokens = args.tokens
    if args.quick:
        levels = [c for c in levels if c <= 256] or [64, 256]
        tokens = min(tokens, 32)
    seqs = max(levels)
    ramp = tokens * args.step_ms / 1000  # one stream's length: the load is steady after it
    steady = (ramp, args.steady) if args.steady > 0 else None
    py = sys.executable
    servers: dict[str, ServerProcess] = {}
    rows: list[dict] = []
    try:
        log("starting the bare server and the gateway (--fake) ...")
        port = free_port()
        servers["bare"] = ServerProcess(
            "bare", [py, str(Path(__file__).resolve()), "--serve-bare", str(port),
                     "--step-ms", str(args.step_ms)], port)
        port = free_port()
        servers["gateway"] = ServerProcess(
            "gateway", [py, "-m", "gateway", "--fake", "--port", str(port),
                        "--fake-step-ms", str(args.step_ms), "--max-num-seqs", str(seqs),
                        "--max-queue", str(max(1024, 2 * seqs)), "--keepalive-seconds", "60"],
            port)
        for s in servers.values():  # warm-up: imports, first-request paths, tokenizer
            measure(s, 8, 4, prewarm=False)
        for c in levels:
            for name in ("bare", "gateway"):
                log(f"{name}: {c} streams x {tokens} tokens ...")
                r = measure(servers[name], c, tokens, prewarm=not args.no_prewarm,
                            steady=steady)
                log(f"  {r['tokens_per_s']:.0f} tok/s, TTFT p99 {r['ttft_p99_ms']:.1f} ms, "
                    f"client CPU {100 * r['client_cpu_share']:.0f}%, "
                    f"server CPU {100 * r['server_cpu_share']:.0f}%, errors {r['errors']}")
                rows.append(r)
    finally:
        for s in servers.values():
            s.stop()

    comparisons = []
    for c in levels:
        bare = next(r for r in rows if r["concurrency"] == c and r["system"] == "bare")
        gw = next(r for r in rows if r["concurrency"] == c and r["system"] == "gateway")
        comparisons.append({
            "concurrency": c,
            "throughput_ratio": gw["tokens_per_s"] / bare["tokens_per_s"],
            "added_ttft_p50_ms": gw["ttft_p50_ms"] - bare["ttft_p50_ms"],
            "added_ttft_p99_ms": gw["ttft_p99_ms"] - bare["ttft_p99_ms"],
            "added_itl_p50_ms": gw["itl_p50_ms"] - bare["itl_p50_ms"],
            "added_itl_p99_ms": gw["itl_p99_ms"] - bare["itl_p99_ms"],
            "same_text": bare["distinct_texts"] == gw["distinct_texts"],
            "gateway_queue_p99_ms": gw["gateway_queue_p99_ms"],
        })

    table = []
    for r in rows:
        cmp = next(x for x in comparisons if x["concurrency"] == r["concurrency"])
        gw = r["system"] == "gateway"
        table.append([r["concurrency"], r["system"], fmt(r["tokens_per_s"], 0),
                      fmt(r["ttft_p50_ms"], 1), fmt(r["ttft_p99_ms"], 1),
                      fmt(r["itl_p50_ms"], 1), fmt(r["itl_p99_ms"], 1),
                      fmt(cmp["throughput_ratio"], 2) if gw else "1.00",
                      fmt(cmp["added_ttft_p99_ms"], 1) if gw else "-",
                      f"{100 * r['client_cpu_share']:.0f}%", f"{100 * r['server_cpu_share']:.0f}%",
                      r["errors"]])
    headers = ["streams", "system", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
               "ITL p99 ms", "vs bare", "added TTFT p99 ms", "client CPU", "server CPU",
               "errors"]
    print(markdown_table(headers, table))
    print()
    for cmp in comparisons:
        print(f"{cmp['concurrency']} streams: throughput ratio {cmp['throughput_ratio']:.2f}, "
              f"added TTFT p50/p99 {cmp['added_ttft_p50_ms']:.1f}/{cmp['added_ttft_p99_ms']:.1f}"
              f" ms, added ITL p50/p99 {cmp['added_itl_p50_ms']:.1f}/"
              f"{cmp['added_itl_p99_ms']:.1f} ms, gateway x-queue-seconds p99 "
              f"{fmt(cmp['gateway_queue_p99_ms'], 1)} ms, same text: {cmp['same_text']}")
    t256 = next((x for x in comparisons if x["concurrency"] == 256), None)
    if t256:
        ok = t256["throughput_ratio"] >= 0.5 and t256["added_ttft_p99_ms"] < 10.0
        print(f"target at 256 streams (>= 0.5x bare throughput, added TTFT p99 < 10 ms): "
              f"{'met' if ok else 'NOT met'}")
    print("client/server CPU: CPU seconds / wall seconds of the load (100% = one core); "
          f"this machine has {os.cpu_count()} cores shared by client, servers and others.")

    out = write_json(args.out, {
        "benchmark": "gateway", "step_ms": args.step_ms, "tokens_per_stream": tokens,
        "concurrency": levels, "prewarmed_connections": not args.no_prewarm,
        "mode": f"steady {args.steady:g} s after a {ramp:g} s ramp" if steady else "burst",
        "gateway_max_num_seqs": seqs, "machine": machine_info(),
        "results": rows, "comparisons": comparisons})
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
