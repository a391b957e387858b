"""A deliberately broken OpenAI-style server for the load tester's failure accounting.

The last word of the prompt picks what it does ("mode:NAME"); see MODES. It serves
/v1/chat/completions (SSE or JSON), /v1/ws (our WebSocket protocol) and /v1/models.
"""
from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

GAP = 0.02  # seconds between content chunks


def chunk(content=None, finish=None, role=False, usage=None) -> dict:
    delta = {"role": "assistant", "content": ""} if role else (
        {} if content is None else {"content": content})
    c = {"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        c = {"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": usage}
    return c


def usage(n: int) -> dict:
    return {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n,
            "prompt_tokens_details": {"cached_tokens": 4}}


OK = [chunk(role=True), chunk(" a"), chunk(" b"), chunk(" c"), chunk(" d"),
      chunk(finish="length"), chunk(usage=usage(4))]
MB = [chunk(role=True), chunk("日"), chunk("🙂"), chunk("本"), chunk(finish="stop")]
# every script is a list of chunks (dicts), b"raw" lines, or "close" (drop the connection)
MODES = {
    "ok": OK + ["done"],
    "multi": [chunk(role=True), chunk(" a b"), chunk(" c d"), chunk(finish="length"),
              chunk(usage=usage(4)), "done"],
    "truncate": OK[:3] + ["close"],
    "badframe": OK[:2] + [b"data: {not json"],
    "error_event": OK[:2] + [{"error": {"message": "boom", "type": "server_error"}}, "done"],
    "no_finish": OK[:5] + ["done"],
    # fewer tokens than messages with text: impossible, each message carries one at least
    "lie": OK[:5] + [chunk(finish="length"), chunk(usage=usage(2)), "done"],
    # a multi-byte character of two byte tokens arrives as one message once it is whole, as
    # our gateway streams it: three messages, four tokens
    "mb": MB + [chunk(usage=usage(4)), "done"],
    "mb_nousage": MB + ["done"],  # the same without a usage: counted one per message
    "http500": [500],
    "http429": [429],
}


def mode_of(body: dict) -> str:
    text = (body.get("messages") or [{}])[-1].get("content", "")
    return text.rsplit("mode:", 1)[-1].strip() if "mode:" in text else "ok"


async def chat(request: web.Request) -> web.StreamResponse:
    try:
        return await _chat(request)
    except ConnectionError:  # the client hung up after the failure it was looking for
        return web.Response()


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    script = MODES[mode_of(body)]
    if isinstance(script[0], int):
        return web.json_response({"error": {"message": "nope", "type": "x"}}, status=script[0])
    if not body.get("stream"):
        return web.json_response({"choices": [{"index": 0, "message": {
            "role": "assistant", "content": " a b c d"}, "finish_reason": "length"}],
            "usage": usage(4)})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b": keep-alive\n\n")
    for step in script:
        await asyncio.sleep(GAP)
        if step == "close":
            request.transport.close()
            return resp
        if step == "done":
            await resp.write(b"data: [DONE]\n\n")
        elif isinstance(step, bytes):
            await resp.write(step + b"\n\n")
        else:
            await resp.write(b"data: " + orjson.dumps(step) + b"\n\n")
    await resp.write_eof()
    return resp


async def ws(request: web.Request) -> web.WebSocketResponse:
    sock = web.WebSocketResponse()
    await sock.prepare(request)
    async for msg in sock:
        m = orjson.loads(msg.data)
        asyncio.create_task(_ws_request(sock, m["id"], MODES[mode_of(m["body"])]))
    return sock


async def _ws_request(sock, rid: str, script: list) -> None:
    if isinstance(script[0], int):
        return await sock.send_str(orjson.dumps({"type": "error", "id": rid, "error": {
            "message": "nope", "type": "x"}}).decode())
    for step in script:
        await asyncio.sleep(GAP)
        if step == "close":
            return await sock.close()
        if isinstance(step, bytes):
            return await sock.send_str("{not json")
        if step == "done":
            return await sock.send_str(orjson.dumps({"type": "done", "id": rid,
                                                     "usage": _usage_in(script)}).decode())
        if "error" in step:
            return await sock.send_str(orjson.dumps({"type": "error", "id": rid,
                                                     "error": step["error"]}).decode())
        if step.get("choices"):
            await sock.send_str(orjson.dumps({"type": "chunk", "id": rid,
                                              "data": step}).decode())
    return None


def _usage_in(script: list) -> dict | None:
    for step in script:
        if isinstance(step, dict) and step.get("usage"):
            return step["usage"]
    return None


async def models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "broken"}]})


async def start() -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/ws", ws)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"
