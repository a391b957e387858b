"""Workloads: endless (or, for traces, finite) deterministic streams of requests to send.

shared-prefix  --num-prefixes reports of --prefix-len words; each request is one of them
               followed by a fresh question of --input-len words (many users, same report).
chat           --users conversations of --turns turns; each turn re-sends the whole history
               (user turns of --input-len words, assistant replies of --output-len words, made
               up locally so the workload does not depend on the server), then starts anew.
               Turns are interleaved across users: turn k+1 of a user follows --users requests
               after turn k.
random         a prompt of --input-len words and --output-len tokens, each drawn from its
               distribution (see dists.py).
trace:FILE     JSONL, one request a line: {"timestamp": s, "prompt": str | "input_length": n,
               "output_length": n, "tenant": name, "priority": int}; timestamps drive arrivals.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson

from loadtest.dists import Dist
from loadtest.mix import Mix
from loadtest.text import words


@dataclass
class RequestSpec:
    """One request to send: `body` lacks stream flags and model, which the client adds."""
    index: int
    tenant: str
    api_key: str | None
    priority: int | None
    messages: list[dict]
    max_tokens: int
    arrival: float | None = None  # trace timestamp (seconds from the trace's start)
    extra: dict = field(default_factory=dict)

    @property
    def prompt_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


@dataclass(frozen=True)
class WorkloadParams:
    input_len: Dist = Dist("fixed", 32)
    output_len: Dist = Dist("fixed", 32)
    prefix_len: int = 1024
    num_prefixes: int = 1
    users: int = 16
    turns: int = 4


def make_workload(name: str, params: WorkloadParams, mix: Mix, seed: int,
                  default_key: str | None = None) -> Iterator[RequestSpec]:
    rng = random.Random(seed)
    if name == "shared-prefix":
        gen = _shared_prefix(params, rng)
    elif name == "chat":
        gen = _chat(params, rng)
    elif name == "random":
        gen = _random(params, rng)
    elif name.startswith("trace:"):
        return _trace(name[len("trace:"):], mix, default_key)
    else:
        raise ValueError(f"unknown workload {name!r}: shared-prefix, chat, random, trace:FILE")
    return _with_mix(gen, mix, rng)


def _with_mix(gen, mix: Mix, rng: random.Random) -> Iterator[RequestSpec]:
    for i, (messages, max_tokens) in enumerate(gen):
        tenant, prio = mix.draw(rng)
        yield RequestSpec(i, tenant.name, tenant.api_key, prio, messages, max_tokens)


def _shared_prefix(p: WorkloadParams, rng: random.Random):
    reports = [f"Read this report, then answer the question after it.\n{words(rng, p.prefix_len)}"
               for _ in range(p.num_prefixes)]
    while True:
        report = rng.choice(reports)
        question = f"\nQuestion:{words(rng, p.input_len.draw(rng))}?"
        yield [{"role": "user", "content": report + question}], p.output_len.draw(rng)


def _chat(p: WorkloadParams, rng: random.Random):
    histories: list[list[dict]] = [[] for _ in range(p.users)]
    while True:
        for history in histories:
            if len(history) >= 2 * p.turns:
                history.clear()
            history.append({"role": "user", "content": words(rng, p.input_len.draw(rng))})
            out = p.output_len.draw(rng)
            yield [dict(m) for m in history], out
            history.append({"role": "assistant", "content": words(rng, out)})


def _random(p: WorkloadParams, rng: random.Random):
    while True:
        yield ([{"role": "user", "content": words(rng, p.input_len.draw(rng))}],
               p.output_len.draw(rng))


def _trace(path: str, mix: Mix, default_key: str | None) -> Iterator[RequestSpec]:
    rng = random.Random(0)  # filler words for lines that give only a length
    with open(path, "rb") as fh:
        lines = [orjson.loads(line) for line in fh if line.strip()]
    for i, row in enumerate(lines):
        prompt = row.get("prompt")
        if prompt is None:
            prompt = words(rng, int(row.get("input_length", 32)))
        tenant = mix.tenant(row.get("tenant"), default_key)
        prio = row.get("priority", mix.priorities[0][0])
        yield RequestSpec(i, tenant.name, tenant.api_key, prio,
                          [{"role": "user", "content": prompt}],
                          int(row.get("output_length", 32)), arrival=float(row["timestamp"]))
