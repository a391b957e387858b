"""The OpenAPI document: serialisable, complete (every route the app registers, the admin
routes and the WebSocket's messages included), every $ref points at a defined schema, valid
against the OpenAPI 3.1 schema, and its ranges are the validators' own constants."""
from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import OpenAPIV31SpecValidator

from contract.sampling_params import MAX_SEED, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, MIN_SEED
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.http.openapi import build_openapi
from gateway.http.websocket import MAX_REQUESTS_PER_SOCKET
from gateway.openai.requests import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_N
from gateway.openai.schema import admin, websocket
from gateway.openai.tools import MAX_TOOLS
from testkit.gateway_server import GatewayProcess

# routes the app registers that the document leaves out on purpose, and why
LEFT_OUT = {"HEAD": "aiohttp answers HEAD on every GET route; the GET documents it"}


def _refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _doc(names=("smol",)) -> dict:
    return orjson.loads(orjson.dumps(build_openapi(names)))


def _registered(tmp_path) -> set[tuple[str, str]]:
    """(method, path) of every route the gateway's app registers, from its aiohttp router."""
    app = create_app(GatewayConfig(fake=True, ledger_path=str(tmp_path / "ledger.sqlite3")))
    return {(r.method, r.resource.canonical) for r in app.router.routes()}


def _documented(doc: dict) -> set[tuple[str, str]]:
    methods = {"get", "post", "put", "patch", "delete", "head", "options"}
    return {(m.upper(), path) for path, item in doc["paths"].items() for m in item
            if m in methods}


def test_every_registered_route_is_documented_and_no_other(tmp_path):
    registered = {(m, p) for m, p in _registered(tmp_path) if m not in LEFT_OUT}
    documented = _documented(_doc())
    assert registered - documented == set(), "routes missing from /openapi.json"
    assert documented - registered == set(), "documented routes the app does not have"
    assert {p for _, p in registered if p.startswith("/admin/")} >= {
        "/admin/usage", "/admin/telemetry", "/admin/workers", "/admin/workers/{index}",
        "/admin/fleet"}


def test_document_resolves_refs():
    doc = _doc("smol")
    assert doc["openapi"] == "3.1.0"
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]) == {"200", "400", "401", "402", "429", "503"}
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["maximum"] == MAX_N
    usage = schemas["Usage"]["properties"]
    assert "cached_tokens" in schemas[usage["prompt_tokens_details"]["$ref"].rsplit("/")[-1]][
        "properties"]
    assert '"type": "cancel"' in doc["paths"]["/v1/ws"]["get"]["description"]


def test_document_is_valid_openapi_3_1():
    OpenAPIV31SpecValidator(_doc(("smol", "alias"))).validate()


def test_ranges_are_the_validators_constants():
    schemas = _doc()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert (chat["messages"]["minItems"], chat["messages"]["maxItems"]) == (1, MAX_MESSAGES)
    assert (chat["seed"]["minimum"], chat["seed"]["maximum"]) == (MIN_SEED, MAX_SEED)
    assert chat["top_logprobs"]["maximum"] == MAX_TOP_LOGPROBS
    assert chat["tools"]["maxItems"] == MAX_TOOLS
    assert [s.get("maxItems") for s in chat["stop"]["oneOf"]] == [None, MAX_STOP_STRINGS, None]
    parts = [s for s in schemas["TextMessage"]["properties"]["content"]["oneOf"]
             if s["type"] == "array"]
    assert parts[0]["maxItems"] == MAX_CONTENT_PARTS


def test_refused_fields_are_not_offered_and_model_names_are():
    schemas = _doc(("smol", "alias"))["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert not {"functions", "logit_bias", "suffix", "best_of"} & set(chat)
    assert chat["model"]["enum"] == ["smol", "alias", None]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]


def test_websocket_messages_are_described_both_ways():
    doc = _doc()
    ws = doc["paths"]["/v1/ws"]["get"]
    assert set(ws["responses"]) == {"101", "401"}
    messages = ws["x-websocket-messages"]
    for side, declared in (("client", websocket.CLIENT_MESSAGES),
                           ("server", websocket.SERVER_MESSAGES)):
        refs = [r["$ref"].rsplit("/", 1)[-1] for r in messages[side]["oneOf"]]
        assert refs == list(declared), side
    schemas = doc["components"]["schemas"]
    kinds = {schemas[n]["properties"]["type"]["const"] for n in websocket.COMPONENTS}
    assert kinds == {"request", "cancel", "queued", "chunk", "done", "error"}
    body = schemas["WsRequest"]["properties"]["body"]["oneOf"]
    assert [b["$ref"].rsplit("/", 1)[-1] for b in body] == ["ChatCompletionRequest",
                                                             "CompletionRequest"]
    assert f"At most {MAX_REQUESTS_PER_SOCKET} requests" in ws["description"]
    assert f"at most {MAX_REQUESTS_PER_SOCKET} in flight" in schemas["WsRequest"]["description"]


def test_admin_routes_name_their_schemas():
    doc = _doc()
    schemas = doc["components"]["schemas"]
    assert set(admin.COMPONENTS) <= set(schemas)
    workers = doc["paths"]["/admin/workers"]
    assert workers["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AddWorkerRequest"}
    assert set(workers["post"]["responses"]) == {"201", "400", "401", "403", "409", "502"}
    usage = doc["paths"]["/admin/usage"]["get"]
    assert [p["name"] for p in usage["parameters"]] == ["period", "tenant", "since", "until"]
    assert set(doc["paths"]["/admin/workers/{index}"]["delete"]["responses"]) >= {"200", "202"}


@pytest.fixture(scope="module")
def live():
    """A fake-engine gateway running one request at a time, so others queue (key-less: every
    caller is admin)."""
    gw = GatewayProcess("--fake", "--fake-step-ms", "5", "--max-num-seqs", "1")
    yield gw
    gw.stop()


def _conforms(doc: dict, schema: dict, value) -> None:
    """`value` against `schema`, its `$ref`s resolved in the served document."""
    errors = list(Draft202012Validator({**doc, **schema}).iter_errors(value))
    assert not errors, (schema, value, [e.message for e in errors])


def _ref(name: str) -> dict:
    return {"$ref": "#/components/schemas/" + name}


async def _http(session, method: str, url: str, **kwargs) -> tuple[int, object]:
    async with session.request(method, url, **kwargs) as r:
        return r.status, await r.json()


def test_live_admin_answers_match_the_document(live):
    async def main():
        async with aiohttp.ClientSession() as s:
            doc = (await _http(s, "GET", live.url + "/openapi.json"))[1]
            await _http(s, "POST", live.url + "/v1/completions",
                        json={"prompt": "x", "max_tokens": 2})  # a ledger row to total
            answers = [(await _http(s, "GET", live.url + path), name) for path, name in (
                ("/health", "Health"), ("/ready", "Readiness"), ("/admin/workers", "WorkerList"),
                ("/admin/usage?period=all", "UsageReport"), ("/admin/fleet", "Fleet"))]
            added = await _http(s, "POST", live.url + "/admin/workers", json={"spawn": True})
            index = added[1]["index"]
            removed = await _http(s, "DELETE", f"{live.url}/admin/workers/{index}?wait=true")
            return doc, [*answers, (added, "Worker"), (removed, "RemovedWorker")]
    doc, answers = asyncio.run(main())
    assert answers[3][0][1]["data"], "the ledger row is totalled"
    for (status, body), name in answers:
        assert status in (200, 201), (name, body)
        _conforms(doc, _ref(name), body)


def test_live_websocket_messages_match_the_document(live):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    sent = [{"type": "request", "id": "long", "endpoint": "completions",
             "body": {"prompt": "x", "max_tokens": 400}},
            {"type": "request", "id": "chat", "endpoint": "chat", "body": chat},
            {"type": "request", "id": "plain", "body": chat}]  # endpoint omitted: chat

    async def main():
        received = []
        async with aiohttp.ClientSession() as s:
            doc = (await _http(s, "GET", live.url + "/openapi.json"))[1]
            async with s.ws_connect(live.url + "/v1/ws") as ws:
                for message in sent:
                    await ws.send_json(message)
                await ws.send_str("not json")
                ended: set = set()
                while len(ended) < 3:
                    msg = orjson.loads((await ws.receive()).data)
                    received.append(msg)
                    if msg["type"] == "chunk" and msg["id"] == "long" and len(sent) == 3:
                        sent.append({"type": "cancel", "id": "long"})
                        await ws.send_json(sent[-1])
                    elif msg["type"] in ("done", "error") and msg["id"] is not None:
                        ended.add(msg["id"])
        return doc, received
    doc, received = asyncio.run(main())
    client = doc["paths"]["/v1/ws"]["get"]["x-websocket-messages"]["client"]
    server = doc["paths"]["/v1/ws"]["get"]["x-websocket-messages"]["server"]
    for message in sent:
        _conforms(doc, client, message)
    for message in received:
        _conforms(doc, server, message)
    kinds = {(m["type"], m["id"]) for m in received}
    assert {("queued", "chat"), ("done", "chat"), ("done", "plain"), ("error", "long"),
            ("error", None)} <= kinds, kinds


def test_the_readme_websocket_example_matches_the_document():
    """The README's exchange: each line sent (`>`) a client message, each received (`<`) a
    server message, as the document declares them."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### The WebSocket protocol", 1)[1].split("\n### ", 1)[0]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    doc = _doc()
    messages = doc["paths"]["/v1/ws"]["get"]["x-websocket-messages"]
    lines = [line for line in block.splitlines() if line.strip()]
    assert {line[0] for line in lines} == {">", "<"}
    for line in lines:
        _conforms(doc, messages["client" if line[0] == ">" else "server"],
                  orjson.loads(line[2:]))
