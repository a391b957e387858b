"""Regenerate tests/console/data/feed.jsonl by recording a real gateway (fake engine) under load.

    .venv/bin/python -m tests.console.make_feed [--seconds 12] [--out PATH]

Three tenants on a key file, an admin key for the feed, shared-prefix prompts (so the cache
hits) at two priority classes. The recording is what `python -m console --record` writes.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import tempfile
from pathlib import Path

import aiohttp

from console.feed import Frame, LiveFeed, Recorder
from testkit.gateway_server import GatewayProcess

ADMIN_KEY = "sk-console-admin"
TENANTS = {"acme": "sk-acme", "globex": "sk-globex", "initech": "sk-initech"}
DEFAULT_OUT = Path(__file__).parent / "data" / "feed.jsonl"


def write_keys(path: Path) -> None:
    lines = []
    for tenant in TENANTS:
        lines += [f"[tenants.{tenant}]", "priority = 0", ""]
    keys = [(ADMIN_KEY, "acme", "true")] + [(k, t, "false") for t, k in TENANTS.items()]
    for key, tenant, admin in keys:
        digest = hashlib.sha256(key.encode()).hexdigest()
        lines += ["[[keys]]", f'sha256 = "{digest}"', f'tenant = "{tenant}"',
                  f'name = "{tenant}-{admin}"', f"admin = {admin}", ""]
    path.write_text("\n".join(lines))


async def drive_load(url: str, seconds: float, seed: int = 7) -> None:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    prefixes = {t: f"You are the {t} assistant. " * 6 for t in TENANTS}

    async def client(session: aiohttp.ClientSession, n: int) -> None:
        while loop.time() < deadline:
            tenant = rng.choice(list(TENANTS))
            body = {"prompt": prefixes[tenant] + f"question {rng.randrange(5)}",
                    "max_tokens": rng.choice([8, 20, 40]), "priority": n % 2}
            headers = {"Authorization": f"Bearer {TENANTS[tenant]}"}
            async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
                await r.read()
            await asyncio.sleep(rng.random() * 0.5)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session, n) for n in range(4)))


async def record(url: str, out: Path, seconds: float) -> int:
    recorder = Recorder(out)
    frames = 0

    async def read() -> None:
        nonlocal frames
        async for event in LiveFeed(url, ADMIN_KEY, recorder=recorder).events():
            frames += isinstance(event, Frame)

    reader = asyncio.create_task(read())
    await asyncio.sleep(1.5)  # hello and a first idle snapshot
    load = asyncio.create_task(drive_load(url, seconds + 1.0))
    await asyncio.sleep(seconds)  # stop while the load runs: the last snapshot is a busy one
    reader.cancel()
    recorder.close()
    await load
    return frames


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.toml"
        write_keys(keys)
        gw = GatewayProcess("--fake", "--fake-step-ms", "5", "--keys-file", str(keys))
        try:
            frames = asyncio.run(record(gw.url, args.out, args.seconds))
        finally:
            gw.stop()
    print(f"{frames} frames -> {args.out}")


if __name__ == "__main__":
    main()
