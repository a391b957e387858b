"""One stream against the memory-bandwidth bound (issue 35): how fast could a batch-1 decode
step be on this machine, and how close does one stream come?

    python -m bench.bandwidth                        # SmolLM2 as `make run` serves it
    python -m bench.bandwidth --buffer-mb 512 --tokens 16 --no-gateway   # a quick look

A batch-1 decode step must read every weight once, in the form it is served (the file's blocks,
int8 rows or floats, whichever a one-row step runs: runtime/models/linear.py), plus the KV cache
of its context. The machine's streaming read rate is measured with every core reading (torch's
sum over a buffer many times the last-level cache, so every pass comes from DRAM: cold caches),
best of a few passes. bound steps/s = read rate / bytes per step. The single-stream decode rate
is measured on the loaded engine directly (median step once decoding) and, unless
--no-gateway, through the gateway as `make run` starts it (streamed tokens after the first over
the time after the first), each reported as a fraction of the bound, with the CPU model and the
ISA extensions that matter to the kernels in the table.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch

from bench.common import REPO_ROOT, best_time, log, machine_info, markdown_table, median
from bench.common import write_json as _write_json

ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
PROMPT_TOKENS = 64


def isa_flags() -> list[str]:
    """The vector extensions the CPU reports that our kernels can use."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in ISA_FLAGS if flag in have]
    except OSError:
        pass
    return []


def last_level_cache_bytes() -> int:
    """The largest cache level of cpu0 (sysfs), 0 when unknown."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        for entry in os.listdir(base):
            try:
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
            except OSError:
                continue
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return best


def read_rate_gbs(nbytes: int, threads: int, reps: int = 5) -> float:
    """GB/s read by `threads` threads summing an `nbytes` float32 buffer (best of `reps`)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        seconds = best_time(buf.sum, reps=reps, warmup=1)
        del buf
    finally:
        torch.set_num_threads(previous)
    return nbytes / seconds / 1e9


def linear_step_bytes(lin) -> int:
    """Bytes one Linear reads for a one-row step: the form that size runs, and its bias."""
    bias = 0 if lin.bias is None else lin.bias.numel() * lin.bias.element_size()
    if lin.small is not None and lin.max_small_rows >= 1:
        return lin.small.nbytes + bias
    if lin.packed is not None and lin.max_quant_rows >= 1:
        return lin.packed.nbytes + bias
    return lin.float_bytes + bias


def decode_step_bytes(engine, context: int) -> dict:
    """What a batch-1 decode step at `context` tokens reads: every Linear in its one-row form,
    the norms' vectors, one embedding row, and the KV cache of the context."""
    model = engine.runner.model
    linears = sum(linear_step_bytes(lin) for lin in model.linears())
    vectors = model.norm.numel() * model.norm.element_size()
    for layer in model.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor) and value.dim() == 1:
                vectors += value.numel() * value.element_size()
    cfg = engine.model_config
    embed_row = cfg.hidden_size * 4
    kv_per_token = cfg.kv_bytes_per_token // 4 * engine.runner.kv_dtype.itemsize
    kv = kv_per_token * context
    return {"linear_bytes": linears, "vector_bytes": vectors, "embed_row_bytes": embed_row,
            "kv_bytes": kv, "kv_bytes_per_token": kv_per_token,
            "total_bytes": linears + vectors + embed_row + kv,
            "quantization": model.quantization, "kv_dtype": str(engine.runner.kv_dtype)}


def engine_decode_rate(engine, tokens: int) -> tuple[float, list[float]]:
    """Decode tokens/s of one stream on the engine itself: 1 / median step once decoding."""
    from contract.sampling_params import SamplingParams
    prompt = [(i * 37) % 1000 + 100 for i in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    engine.add_request("bandwidth", prompt, params)
    engine.step()  # the prompt and the first token
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return 1.0 / median(times), times


async def _gateway_stream(url: str, tokens: int) -> float:
    import aiohttp
    import orjson
    prompt = [(i * 37) % 1000 + 100 for i in range(PROMPT_TOKENS)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        rate = 0.0
        for _ in range(2):  # the first warms the request paths; the second is measured
            body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": tokens,
                                 "stream": True, "ignore_eos": True, "temperature": 0.0})
            times = []
            async with session.post(url + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    if any(c.get("text") for c in orjson.loads(line[6:])["choices"]):
                        times.append(time.perf_counter())
            rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        return rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--buffer-mb", type=int, default=0,
                   help="read-rate buffer (default: 4x the last-level cache, at least 1 GiB, "
                        "at most a quarter of the memory available)")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens per stream")
    p.add_argument("--threads", type=int, default=None, help="default: every core")
    p.add_argument("--model", default=None, help="a .gguf or HF folder (default: SmolLM2)")
    p.add_argument("--no-gateway", action="store_true", help="the engine alone")
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/bandwidth.json"))
    a = p.parse_args(argv)
    from bench.common import setup_threads
    threads = setup_threads(a.threads)
    llc = last_level_cache_bytes()
    nbytes = a.buffer_mb << 20 if a.buffer_mb else _default_buffer(llc)
    log(f"[bandwidth] reading {nbytes >> 20} MiB with {threads} threads "
        f"(last-level cache {llc >> 20} MiB) ...")
    rate = read_rate_gbs(nbytes, threads)

    from contract.config import EngineConfig
    from runtime.engine import LLMEngine
    log("[bandwidth] loading the engine as `make run` serves it ...")
    engine = LLMEngine.from_model_path(a.model, EngineConfig())
    context = PROMPT_TOKENS + a.tokens // 2  # the mean context over the decode
    step = decode_step_bytes(engine, context)
    bound = rate * 1e9 / step["total_bytes"]
    engine_rate, _ = engine_decode_rate(engine, a.tokens)
    rows = [["engine", f"{engine_rate:.1f}", f"{bound:.1f}", f"{engine_rate / bound:.2f}"]]
    gateway_rate = None
    if not a.no_gateway:
        del engine
        from bench.engine_servers import start_ours
        log("[bandwidth] one stream through the gateway ...")
        server = start_ours(a.model)
        try:
            gateway_rate = asyncio.run(_gateway_stream(server.url, a.tokens))
        finally:
            server.stop()
        rows.append(["gateway", f"{gateway_rate:.1f}", f"{bound:.1f}",
                     f"{gateway_rate / bound:.2f}"])
    info = machine_info()
    isa = isa_flags()
    print(f"\nCPU: {info['cpu']}, {threads} threads; ISA: {' '.join(isa) or 'none listed'}")
    print(f"read rate {rate:.1f} GB/s ({nbytes >> 20} MiB buffer, last-level cache "
          f"{llc >> 20} MiB); a batch-1 step at {context} tokens of context reads "
          f"{step['total_bytes'] / 1e6:.1f} MB (weights {step['quantization']}: "
          f"{step['linear_bytes'] / 1e6:.1f} MB, KV {step['kv_dtype']}: "
          f"{step['kv_bytes'] / 1e6:.2f} MB) -> bound {bound:.1f} steps/s\n")
    table = markdown_table(["one stream", "decode tok/s", "bound tok/s", "fraction of bound"],
                           rows)
    print(table)
    _write_json(a.out, {"benchmark": "bandwidth", "args": vars(a), "machine": info,
                        "isa": isa, "last_level_cache_bytes": llc, "buffer_bytes": nbytes,
                        "read_gbs": rate, "context_tokens": context, "step": step,
                        "bound_steps_per_s": bound, "engine_tok_s": engine_rate,
                        "gateway_tok_s": gateway_rate, "table_markdown": table})
    return 0


def _default_buffer(llc: int) -> int:
    """4x the last-level cache, at least 1 GiB, at most a quarter of the available memory."""
    want = max(4 * llc, 1 << 30)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    want = min(want, int(line.split()[1]) * 1024 // 4)
    except OSError:
        pass
    return want


if __name__ == "__main__":
    sys.exit(main())
