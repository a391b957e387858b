"""An in-process fleet in virtual time, for the prefix-routing tests and bench/prefix_routing.py.

Fake engines (runtime/fake_engine.py) run inside the real worker loop (runtime/transport/worker.py)
behind real worker handles, placed by the real dispatcher; frames cross as bytes, encoded and
decoded as on a pipe. Each worker has its own virtual clock: a step starts when the worker has
work, costs what the fake's cost model says (its step time plus its prefill time for the prompt
tokens its cache did not serve), and its frames (outputs, then KV events) reach the gateway when
the step ends. So a run measures routing, not this machine, and takes only bookkeeping time.

The workload is multi-tenant conversations over shared system prompts: each tenant has a few
long system prompts (which may open with a preamble common to the tenant's prompts, as a
company's policy text would); each conversation picks one and sends several short user turns,
every turn re-sending the whole history (system prompt, earlier turns, the fake's replies)
under the tenant's salt; a turn arrives a think time after the reply to the previous one.
"""
from __future__ import annotations

import asyncio
import heapq
import math
import random
import struct
from dataclasses import dataclass, field

from contract.frames import decode_frame
from gateway.openai.requests import GenerationRequest
from gateway.serving.dispatch import Dispatcher
from gateway.serving.inflight import InFlightRequest, InFlightTable, Phase
from gateway.serving.queue import RequestQueue
from gateway.workers.handle import WorkerEvents, WorkerHandle
from numeric.percentiles import percentile
from runtime.fake_engine import FakeEngine
from runtime.transport.worker import Worker

_HEADER = struct.Struct(">I")


# ---- the workload ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Conversation:
    tenant: str
    system: tuple[int, ...]
    turns: tuple[tuple[int, ...], ...]  # the user's messages, in order
    start: float  # when the first turn arrives
    think: float  # seconds from a reply to the next turn


@dataclass(frozen=True)
class Workload:
    tenants: int = 4
    prompts_per_tenant: int = 3
    system_tokens: int = 800
    preamble_tokens: int = 0  # how many leading tokens a tenant's system prompts share
    conversations: int = 120
    turns: tuple[int, int] = (2, 5)  # turns per conversation, inclusive
    user_tokens: tuple[int, int] = (20, 60)
    max_tokens: int = 24
    rate: float = 8.0  # new conversations per second (Poisson)
    think: float = 1.0  # mean think time (exponential)
    skew: float = 1.0  # tenant i is chosen with weight 1 / (i + 1) ** skew
    vocab: int = 300  # token ids drawn from 1..vocab-1
    seed: int = 7

    def conversations_list(self) -> list[Conversation]:
        rng = random.Random(self.seed)
        word = lambda n: tuple(rng.randrange(1, self.vocab) for _ in range(n))  # noqa: E731
        preambles = [word(self.preamble_tokens) for _ in range(self.tenants)]
        systems = [[p + word(self.system_tokens - len(p)) for _ in range(self.prompts_per_tenant)]
                   for p in preambles]
        weights = [1 / (i + 1) ** self.skew for i in range(self.tenants)]
        out, t = [], 0.0
        for _ in range(self.conversations):
            t += rng.expovariate(self.rate)
            tenant = rng.choices(range(self.tenants), weights)[0]
            turns = tuple(word(rng.randint(*self.user_tokens))
                          for _ in range(rng.randint(*self.turns)))
            out.append(Conversation(f"tenant-{tenant}", rng.choice(systems[tenant]), turns, t,
                                    rng.expovariate(1 / self.think)))
        return out


# ---- the fleet ------------------------------------------------------------------------------
@dataclass
class Turn:
    """One request of the run: what it sent and what it got."""

    conversation: int
    turn: int
    prompt: list[int]
    arrival: float
    worker: int = -1
    first_token: float | None = None
    cached: int = 0
    output: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


class _Outbox:
    """The worker loop's stdout: frames wait here until the step that wrote them ends."""

    def __init__(self):
        self.data: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.data.append(data)

    def flush(self) -> None:
        pass


class _Stdin:
    """A handle's pipe into the worker loop: each frame decoded and applied at once."""

    def __init__(self, loop: Worker):
        self.loop = loop

    def write(self, data: bytes) -> None:
        for frame in _frames(data):
            self.loop.apply(frame)


class _Proc:
    returncode = None

    def __init__(self, pid: int, stdin: _Stdin):
        self.pid, self.stdin = pid, stdin


def _frames(data: bytes):
    while data:
        (size,) = _HEADER.unpack_from(data)
        yield decode_frame(data[_HEADER.size:_HEADER.size + size])
        data = data[_HEADER.size + size:]


class SimWorker:
    def __init__(self, index: int, events: WorkerEvents, engine_kwargs: dict):
        self.clock = 0.0  # when its step in progress ends (or when it last went idle)
        self.engine = FakeEngine(sleep=self._spend, **engine_kwargs)
        self.outbox = _Outbox()
        self.loop = Worker(self.engine, self.outbox)
        self.handle = WorkerHandle(index, [], events=events)
        # a stand-in with the members of a Process the handle reads (pid, stdin, returncode)
        self.handle.proc = _Proc(1000 + index, _Stdin(self.loop))  # type: ignore[assignment]
        self.handle.info = self.loop.ready_message()
        self.handle.ready.set()

    def _spend(self, seconds: float) -> None:
        self.clock += seconds

    @property
    def stepping(self) -> bool:
        return bool(self.outbox.data)

    def step(self, now: float) -> None:
        """One step of the worker loop from `now` on: its Step frame, then its KvEvents."""
        self.clock = max(self.clock, now)
        self.loop.step()

    def deliver(self) -> None:
        """The step has ended: its frames reach the gateway's handle."""
        data, self.outbox.data = self.outbox.data, []
        for item in data:
            for frame in _frames(item):
                self.handle._handle(frame)


class Fleet:
    """Workers on virtual clocks, one dispatcher, and the conversations' turns as they come."""

    def __init__(self, num_workers: int, tokenizer, *, prefix_routing: bool,
                 affinity_margin: float = 0.25, engine_kwargs: dict | None = None):
        kwargs = {"tokenizer": tokenizer, "step_seconds": 0.02, **(engine_kwargs or {})}
        self.now = 0.0
        events = _Listener(self)
        self.workers = [SimWorker(i, events, kwargs) for i in range(num_workers)]
        self.dispatcher = Dispatcher([w.handle for w in self.workers], RequestQueue(1 << 20),
                                     InFlightTable(), affinity_margin,
                                     prefix_routing=prefix_routing)
        self.turns: dict[str, Turn] = {}
        self._arrivals: list[tuple[float, int, str]] = []
        self._seq = 0

    async def run(self, workload: Workload) -> list[Turn]:
        conversations = workload.conversations_list()
        self._conversations, self._max_tokens = conversations, workload.max_tokens
        for i, c in enumerate(conversations):
            self._arrive(i, 0, list(c.system) + list(c.turns[0]), c.start)
        while True:
            for w in self.workers:
                if not w.stepping and w.engine.has_unfinished_requests():
                    w.step(self.now)
            busy = [w for w in self.workers if w.stepping]
            t_step = min((w.clock for w in busy), default=math.inf)
            t_arrival = self._arrivals[0][0] if self._arrivals else math.inf
            if t_step == t_arrival == math.inf:
                return list(self.turns.values())
            if t_step <= t_arrival:
                worker = min(busy, key=lambda w: w.clock)
                self.now = worker.clock
                worker.deliver()
                self.dispatcher.dispatch_ready()
            else:
                self.now, _, rid = heapq.heappop(self._arrivals)
                self._submit(rid)

    def _arrive(self, conversation: int, turn: int, prompt: list[int], at: float) -> None:
        rid = f"c{conversation}-t{turn}"
        self.turns[rid] = Turn(conversation, turn, prompt, at)
        heapq.heappush(self._arrivals, (at, self._seq, rid))
        self._seq += 1

    def _submit(self, rid: str) -> None:
        turn = self.turns[rid]
        c = self._conversations[turn.conversation]
        request = GenerationRequest("completion", None, None, tuple(turn.prompt),
                                    self._max_tokens, {"ignore_eos": True})
        job = InFlightRequest(rid, request, turn.prompt, "",
                              request.sampling_params(self._max_tokens), 0, c.tenant)
        self.dispatcher.table.move(job, Phase.QUEUED)
        self.dispatcher.enqueue(job)

    def on_output(self, worker: WorkerHandle, out) -> None:
        turn = self.turns[out["id"]]
        turn.worker = worker.index
        if turn.first_token is None and out["tokens"]:
            turn.first_token = self.now
        turn.output += out["tokens"]
        if not out["finished"]:
            return
        turn.cached = out["usage"][1]
        c = self._conversations[turn.conversation]
        nxt = turn.turn + 1
        if nxt < len(c.turns):
            self._arrive(turn.conversation, nxt, turn.prompt + turn.output + list(c.turns[nxt]),
                         self.now + c.think)


class _Listener(WorkerEvents):
    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    def output(self, worker, out) -> None:
        self.fleet.on_output(worker, out)

    def on_kv_events(self, worker, frame) -> None:
        self.fleet.dispatcher.on_kv_events(worker, frame)


# ---- figures --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Figures:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    per_worker: tuple[int, ...]
    evictions: tuple[int, ...]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


def figures(fleet: Fleet, turns: list[Turn]) -> Figures:
    ttfts = [t.ttft for t in turns]
    return Figures(len(turns), sum(len(t.prompt) for t in turns), sum(t.cached for t in turns),
                   sum(ttfts) / max(1, len(ttfts)), percentile(ttfts, 50), percentile(ttfts, 99),
                   tuple(sum(t.worker == w.handle.index for t in turns) for w in fleet.workers),
                   tuple(w.engine.cache.evictions for w in fleet.workers))


def simulate(workload: Workload, tokenizer, *, prefix_routing: bool, num_workers: int = 2,
             affinity_margin: float = 0.25, engine_kwargs: dict | None = None) -> Figures:
    """One run of the workload over a fresh fleet (asyncio only for the dispatcher's futures)."""
    async def main():
        fleet = Fleet(num_workers, tokenizer, prefix_routing=prefix_routing,
                      affinity_margin=affinity_margin, engine_kwargs=engine_kwargs)
        return figures(fleet, await fleet.run(workload))
    return asyncio.run(main())
