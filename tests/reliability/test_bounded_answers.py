"""Answers and stored fields stay bounded (issue 33, memory without bound).

An answer whose size is a product of request parameters (n x prompt_logprobs x the prompt,
n x top_logprobs x max_tokens, n x the echoed prompt) is refused at admission with a 400 naming
the param when its worst case is over the documented cap, before any work; an allowed one is
built without holding the event loop (the after-every-case check in conftest.py). A
Responses request cannot store a multi-megabyte `user`, and a tenant's stored responses are
capped in bytes. An SSE stream that is cancelled or whose client leaves aborts its worker
request at once and is freed without the garbage collector.
"""
from __future__ import annotations

import asyncio
import gc
import sys
import time
import weakref
from types import SimpleNamespace

import pytest

from gateway.http.completions import stream_sse
from gateway.openai.requests import parse_request
from gateway.serving.inflight import InFlightRequest
from gateway.serving.response_store import ResponseStore
from gateway.serving.service import ChoiceDelta
from testkit.loopback import serve_once

LONG_PROMPT = "word " * 2000  # about 2000 tokens


def test_n_times_prompt_logprobs_is_refused_naming_the_param(gw):
    body = {"prompt": LONG_PROMPT, "max_tokens": 1, "n": 8, "prompt_logprobs": 20}
    start = time.monotonic()
    status, out = gw.post_json("/v1/completions", body)
    assert status == 400, str(out)[:200]
    assert out["error"]["param"] == "prompt_logprobs", out
    assert time.monotonic() - start < 2  # refused before any work
    # chat names the same param: its workers score the prompt once per choice too
    status, out = gw.post_json("/v1/chat/completions", {
        "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 1, "n": 8,
        "prompt_logprobs": 20})
    assert status == 400 and out["error"]["param"] == "prompt_logprobs", out


def test_an_allowed_prompt_logprobs_answer_holds_no_loop(gw):
    status, out = gw.post_json("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1,
                                                   "prompt_logprobs": 5})
    assert status == 200, str(out)[:200]
    assert len(out["choices"][0]["prompt_logprobs"]) == out["usage"]["prompt_tokens"]


def test_n_times_top_logprobs_times_max_tokens_is_refused(gw):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 8, "logprobs": True,
            "top_logprobs": 20, "max_tokens": 2000}
    status, out = gw.post_json("/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "top_logprobs", out
    status, out = gw.post_json("/v1/completions", {"prompt": "hi", "n": 8, "logprobs": 20,
                                                   "max_tokens": 2000})
    assert status == 400 and out["error"]["param"] == "logprobs", out


def test_a_default_budget_is_cut_to_what_the_answer_may_hold(gw):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 8, "logprobs": True,
            "top_logprobs": 20}  # no max_tokens: the default shrinks instead of refusing
    status, out = gw.post_json("/v1/chat/completions", body)
    assert status == 200, str(out)[:200]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["completion_tokens"] * 21 <= 32768


def test_echo_times_n_is_refused_over_the_cap(gw):
    prompt = "a" + " " * 300_000  # 300 kB: it would fit the context (about 4700 tokens)...
    status, out = gw.post_json("/v1/completions", {"prompt": prompt, "echo": True, "n": 8,
                                                   "max_tokens": 1})
    assert status == 400 and out["error"]["param"] == "echo", out  # ...8 copies do not
    status, out = gw.post_json("/v1/completions", {"prompt": "echo me", "echo": True, "n": 8,
                                                   "max_tokens": 1})
    assert status == 200 and out["choices"][7]["text"].startswith("echo me")


def test_a_multi_megabyte_responses_user_is_refused(gw):
    body = {"input": "hi", "max_output_tokens": 2, "user": "u" * (900 << 10)}  # < 1 MiB body
    status, out = gw.post_json("/v1/responses", body)
    assert status == 400 and out["error"]["param"] == "user", str(out)[:200]


def test_a_tenants_stored_responses_are_capped_in_bytes():
    store = ResponseStore(3600, 1000, max_bytes_per_tenant=64 << 10)
    text = "x" * (10 << 10)
    for i in range(20):
        response = {"id": f"resp_{i}", "instructions": text, "user": "u" * 256}
        store.put("t", response, ({"role": "user", "content": text},
                                  {"role": "assistant", "content": text}))
    assert store.bytes_of("t") <= 64 << 10
    assert 1 <= len(store) < 20
    assert store.get("t", "resp_19").response["id"] == "resp_19"  # the newest is kept


# ---- the SSE path in process: aborts at once, freed without the garbage collector ------------

class HeldWorker:
    """A service whose one stream yields a delta, then waits like a worker mid-decode; its
    finally is where the real service aborts the worker request."""

    def __init__(self):
        self.aborted_at: float | None = None
        self.first = asyncio.Event()

    async def stream(self, gen):
        try:
            yield ChoiceDelta(0, "hello", [1], None, None)
            self.first.set()
            await asyncio.Event().wait()  # the next token never comes
        finally:
            self.aborted_at = time.monotonic()


def make_record(kind: str = "completion") -> InFlightRequest:
    if kind == "chat":  # a chat stream also splits reasoning and reads tool calls
        req = parse_request("chat", {"messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 4, "stream": True})
        return InFlightRequest("chatcmpl-test", req, [1, 2], "hi", req.sampling_params(4), 0,
                               None)
    req = parse_request("completion", {"prompt": "hi", "max_tokens": 4, "stream": True})
    return InFlightRequest("cmpl-test", req, [1, 2], "hi", req.sampling_params(4), 0, None)


def fake_state(service) -> SimpleNamespace:
    config = SimpleNamespace(keepalive_seconds=0.05, send_timeout_seconds=5.0)
    return SimpleNamespace(service=service, config=config, open_responses=set(), metrics=None,
                           model_name="fake", tool_call_parser=lambda: "hermes",
                           reasoning_parser=lambda: None)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_cancelled_sse_request_is_freed_without_gc(kind):
    worker = HeldWorker()
    refs: list[weakref.ref] = []
    handlers: list[asyncio.Task] = []

    async def handler(request):
        gen = make_record(kind)
        refs.append(weakref.ref(gen))
        handlers.append(asyncio.current_task())
        return await stream_sse(request, fake_state(worker), gen)

    async def client(session, url):
        resp = await session.post(url)
        await resp.content.readuntil(b"\n\n")
        await worker.first.wait()
        gc.disable()  # from here on only reference counting may free the record
        try:
            handlers[0].cancel()  # as a drain or the runner cancels a handler
            await asyncio.gather(handlers[0], return_exceptions=True)
            handlers.clear()
            for _ in range(3):  # callbacks already scheduled run; no collection does
                await asyncio.sleep(0)
            freed = refs[0]() is None
        finally:
            gc.enable()
        resp.close()
        return freed

    assert asyncio.run(serve_once("POST", handler, client)), "the record waited for the GC"
    assert worker.aborted_at is not None


def test_a_client_that_leaves_aborts_the_worker_request_at_once():
    returned: list[float] = []

    class Writing(HeldWorker):
        async def stream(self, gen):  # deltas keep coming, so the gone client is noticed
            try:
                for _ in range(10_000):
                    yield ChoiceDelta(0, "x" * 1024, [1], None, None)
                    self.first.set()
                    await asyncio.sleep(0.001)
            finally:
                self.aborted_at = time.monotonic()

    worker = Writing()

    finalized: list = []

    async def handler(request):
        # a generator left unclosed is closed only when something finalizes it: here never
        # (as when a reference cycle holds it until a collection), so only an explicit close
        # can abort the worker request before the handler returns
        sys.set_asyncgen_hooks(finalizer=finalized.append)
        try:
            return await stream_sse(request, fake_state(worker), make_record())
        finally:
            returned.append(time.monotonic())

    async def client(session, url):
        resp = await session.post(url)
        await resp.content.readuntil(b"\n\n")
        resp.connection.transport.abort()  # the client goes
        resp.close()
        for _ in range(500):
            if returned:
                break
            await asyncio.sleep(0.01)
        return returned

    assert asyncio.run(serve_once("POST", handler, client)), \
        "the handler never noticed the client left"
    for generator in finalized:  # what the deferred finalizer kept, closed now
        asyncio.run(generator.aclose())
    # aborted before the handler returned, not when a collection found the generator
    assert worker.aborted_at is not None and worker.aborted_at <= returned[0]

