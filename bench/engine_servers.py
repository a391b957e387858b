"""Ours against llama.cpp's server over HTTP: the same GGUF, the same chat prompts, streams
counted at the client.

Each server runs alone on the machine in turn (never both at once): ours as `make run` starts
it (`python -m gateway` with its defaults), llama.cpp's `llama-server` built by
bench/peers/build_llama_server.sh with `-np 64 --threads <cores>`. C closed-loop clients each
send a chat request (max_tokens 128, EOS ignored, streaming) and the next one when it ends;
output tokens/s = every streamed token / the wall time from the first send to the last token.
With `busy=True` a spinning process keeps one core busy for the whole measurement (what a load
tester, a build or another tenant's job does to a small machine).
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from bench.gateway_servers import REPO_ROOT, ServerProcess, free_port

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.",
    "Write a short poem about the sea.", "How do I sort a list in Python?",
    "Give me three tips for better sleep.", "What causes rain?",
    "Describe a cat to someone who has never seen one.", "Why is the sky blue?",
    "What is a prime number?", "Summarize the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?", "Name some uses of copper.",
    "What should I pack for a day hike?", "Explain what a database index is.",
    "Why do leaves change colour in autumn?", "How do vaccines work?",
]
OUTPUT_TOKENS = 128
BUILD_SCRIPT = REPO_ROOT / "bench" / "peers" / "build_llama_server.sh"


@dataclass
class ServerRun:
    server: str
    streams: int
    busy: bool
    requests: int
    tokens: int
    wall_s: float
    errors: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else float("nan")


def llama_server_binary() -> str:
    """Build (once, cached outside the repository) and return llama-server's path."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, capture_output=True,
                         text=True, cwd=REPO_ROOT)
    return out.stdout.strip().splitlines()[-1]


def start_llama(model: str, threads: int, slots: int = 64) -> ServerProcess:
    port = free_port()
    argv = [llama_server_binary(), "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "--threads", str(threads), "--threads-batch", str(threads),
            "-c", str(slots * 512), "--no-webui"]
    return ServerProcess("llama.cpp", argv, port, ready_path="/health")


def start_ours(model: str | None, extra: list[str] | None = None) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    if model:
        argv += ["--model", model]
    return ServerProcess("ours", argv + (extra or []), port)


async def _model_name(session, url: str) -> str:
    async with session.get(url + "/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


async def _stream(session, url: str, model: str, question: str) -> int:
    import orjson
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": question}],
                         "max_tokens": OUTPUT_TOKENS, "stream": True, "ignore_eos": True,
                         "temperature": 0.0})
    tokens = 0
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            for choice in orjson.loads(line[6:]).get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    tokens += 1  # one token per chunk on both servers
    return tokens


async def _drive(url: str, streams: int, requests: int) -> tuple[int, int, float]:
    import aiohttp
    # a fresh connection per request: llama-server closes idle keep-alive ones under the client
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    next_index = 0
    tokens = errors = 0

    async def user():
        nonlocal next_index, tokens, errors
        while next_index < requests:
            i = next_index
            next_index += 1
            try:
                # awaited first: `tokens += await ...` would read `tokens` before the await
                # and lose what the other users added meanwhile
                got = await _stream(session, url, model, QUESTIONS[i % len(QUESTIONS)])
                tokens += got
            except Exception as e:  # noqa: BLE001 - counted; the table shows errors
                errors += 1
                print(f"  stream error: {e!r}", file=sys.stderr)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = await _model_name(session, url)
        await _stream(session, url, model, QUESTIONS[0])  # warm: first request compiles, pages in
        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(streams)))
        wall = time.perf_counter() - t0
    return tokens, errors, wall


def spinner() -> subprocess.Popen:
    """One core kept busy by another process for as long as it runs."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def measure(server: ServerProcess, streams: int, requests: int, busy: bool) -> ServerRun:
    neighbour = spinner() if busy else None
    try:
        tokens, errors, wall = asyncio.run(_drive(server.url, streams, requests))
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    return ServerRun(server.name, streams, busy, requests, tokens, wall, errors)


def default_requests(streams: int) -> int:
    """Enough for every client to run two requests (four alone), so the batch stays full."""
    return max(4, 2 * streams)


def run_servers(model: str, streams: list[int], busy_streams: list[int], threads: int,
                our_model: str | None = None, our_flags: list[str] | None = None,
                log=print, busy_peer: bool = False) -> list[ServerRun]:
    """Each server in turn: every stream count quiet, then the busy-neighbour ones (for
    llama.cpp only with `busy_peer`: its threads spin at every barrier beside the busy core,
    and 8 streams took over ten minutes on the 2-core VMs)."""
    runs: list[ServerRun] = []
    for name in ("llama.cpp", "ours"):
        log(f"starting {name}")
        server = start_llama(model, threads) if name == "llama.cpp" else \
            start_ours(our_model, our_flags)
        busy_counts = busy_streams if name == "ours" or busy_peer else []
        try:
            for busy, counts in ((False, streams), (True, busy_counts)):
                for n in counts:
                    run = measure(server, n, default_requests(n), busy)
                    log(f"  {name} {n} streams{' busy' if busy else ''}: "
                        f"{run.tok_s:.1f} tok/s ({run.tokens} tokens, {run.errors} errors)")
                    runs.append(run)
        finally:
            server.stop()
    return runs


def load_average() -> float:
    return os.getloadavg()[0]


def servers_report(runs: list[ServerRun]) -> tuple[str, dict]:
    """The side-by-side table (quiet rows, then busy ones with their share of quiet), and the
    summary for the JSON."""
    from bench.common import markdown_table

    by = {(r.server, r.streams, r.busy): r for r in runs}
    rows, summary = [], {}
    for (server, n, busy), r in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if server != "ours":
            continue
        peer = by.get(("llama.cpp", n, busy))
        ratio = r.tok_s / peer.tok_s if peer and peer.tok_s else float("nan")
        label = f"{n}" + (" (one core busy)" if busy else "")
        entry = {"ours_tok_s": r.tok_s, "llama_tok_s": peer.tok_s if peer else None,
                 "ratio": ratio, "errors": r.errors + (peer.errors if peer else 0)}
        quiet_share = ""
        if busy:
            ours_q, peer_q = by.get(("ours", n, False)), by.get(("llama.cpp", n, False))
            if ours_q:
                entry["ours_busy_over_quiet"] = r.tok_s / ours_q.tok_s
                quiet_share = f"ours {r.tok_s / ours_q.tok_s:.2f}"
            if peer and peer_q:
                entry["llama_busy_over_quiet"] = peer.tok_s / peer_q.tok_s
                quiet_share += f", llama.cpp {peer.tok_s / peer_q.tok_s:.2f}"
        summary[label] = entry
        rows.append([label, f"{peer.tok_s:.1f}" if peer else "n/a", f"{r.tok_s:.1f}",
                     f"**{ratio:.2f}x**" if peer else "n/a", quiet_share])
    table = markdown_table(["concurrent streams", "llama.cpp server tok/s", "ours tok/s",
                            "ours / llama.cpp", "busy / quiet"], rows)
    return table, summary
