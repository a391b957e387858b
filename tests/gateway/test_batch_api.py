"""The Batch API through the official openai client on a fake-engine gateway: chat,
completions and responses lines answered as the same requests are online, malformed lines in
the error file with the rest run, limits, tenants apart, and a cancel while lines run."""
from __future__ import annotations

import time

import openai
import pytest

from testkit.gateway_server import GatewayProcess
from tests.gateway.batch_helpers import (
    contents,
    jsonl,
    ledger_rows,
    line,
    run_batch,
    upload,
    wait_for,
)
from tests.gateway.keyfile import write_key_file

KEYS = {"alice": "alice-key", "bob": "bob-key", "poor": "poor-key"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    keys = write_key_file(tmp / "keys.toml", {"alice": {}, "bob": {},
                                              "poor": {"budget_usd": 1e-9}},
                          [("alice-key", "alice", True, False), ("bob-key", "bob", False, False),
                           ("poor-key", "poor", False, False)])
    server = GatewayProcess("--fake", "--fake-step-ms", "2", "--max-num-seqs", "8",
                            "--keys-file", keys, "--ledger-path", str(tmp / "ledger.sqlite3"),
                            "--batch-max-file-bytes", str(60 << 20), "--batch-max-open", "3")
    server.admin_key = "alice-key"
    server.ledger = str(tmp / "ledger.sqlite3")
    yield server
    server.stop()


def client_of(gw, tenant: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS[tenant], max_retries=0)


CHAT = [{"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 3 + i,
         "temperature": 0} for i in range(3)]
COMPLETIONS = [{"prompt": f"Once {i}", "max_tokens": 2 + i, "temperature": 0} for i in range(3)]
RESPONSES = [{"input": f"Tell {i}", "max_output_tokens": 4 + i, "temperature": 0}
             for i in range(3)]


def test_chat_completions_and_responses_lines_equal_online(gw):
    client = client_of(gw)
    online = [client.chat.completions.create(model="fake-smollm2", **b) for b in CHAT]
    batch, out, errors = run_batch(client, "/v1/chat/completions", [
        line(f"c{i}", "/v1/chat/completions", b) for i, b in enumerate(CHAT)])
    assert batch.status == "completed" and errors == [] and batch.error_file_id is None
    assert batch.request_counts.total == 3 and batch.request_counts.completed == 3
    assert batch.metadata == {"test": "yes"} and batch.completed_at >= batch.in_progress_at
    for i, want in enumerate(online):
        entry = out[f"c{i}"]
        assert entry["error"] is None and entry["response"]["status_code"] == 200
        body = entry["response"]["body"]
        assert entry["response"]["request_id"] == body["id"]
        assert body["choices"][0]["message"]["content"] == want.choices[0].message.content
        assert body["usage"]["completion_tokens"] == want.usage.completion_tokens

    online_c = [client.completions.create(model="fake-smollm2", **b) for b in COMPLETIONS]
    batch, out, errors = run_batch(client, "/v1/completions", [
        line(f"p{i}", "/v1/completions", b) for i, b in enumerate(COMPLETIONS)])
    assert batch.status == "completed" and not errors
    assert [out[f"p{i}"]["response"]["body"]["choices"][0]["text"] for i in range(3)] == \
        [r.choices[0].text for r in online_c]

    online_r = [client.responses.create(model="fake-smollm2", **b) for b in RESPONSES]
    batch, out, errors = run_batch(client, "/v1/responses", [
        line(f"r{i}", "/v1/responses", b) for i, b in enumerate(RESPONSES)])
    assert batch.status == "completed" and not errors
    for i, want in enumerate(online_r):
        body = out[f"r{i}"]["response"]["body"]
        assert body["object"] == "response" and body["id"].startswith("resp_")
        assert body["output"][0]["content"][0]["text"] == want.output_text
        assert body["usage"]["output_tokens"] == want.usage.output_tokens
    # each line billed once, under its own id
    rows = ledger_rows(gw.ledger, "resp_batch")
    assert len(rows) == 3 and all(status == "ok" for _, status, _ in rows)


def test_malformed_lines_go_to_the_error_file_and_the_rest_run(gw):
    client = client_of(gw)
    url = "/v1/chat/completions"
    good = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    raw = jsonl([line("ok1", url, good)]) + b"{not json\n" + jsonl([
        {"method": "POST", "url": url, "body": good},  # no custom_id
        line("ok1", url, good),  # duplicate
        line("bad-url", "/v1/embeddings", good),
        line("other-url", "/v1/completions", {"prompt": "x"}),
        line("bad-body", url, {"messages": [], "max_tokens": -1}),
        line("too-long", url, {"messages": [{"role": "user", "content": "x " * 5000}],
                               "max_tokens": 100000}),
        line("ok2", url, good)]) + b"\n\n"
    f = upload(client, raw)
    batch = client.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h")
    batch = wait_for(client, batch.id)
    out, errors = contents(client, batch)
    assert batch.status == "completed" and set(out) == {"ok1", "ok2"}
    assert batch.request_counts.total == 9 and batch.request_counts.completed == 2
    assert batch.request_counts.failed == 7
    codes = sorted(str((e["error"] or {}).get("code") or e["response"]["status_code"])
                   for e in errors)
    assert codes == sorted(["400", "duplicate_custom_id", "invalid_json_line", "invalid_request",
                            "invalid_url", "mismatched_url", "missing_required_parameter"])
    # the body refused at run time (too long for the context) has the online route's 400
    runtime = next(e for e in errors if e["custom_id"] == "too-long")
    assert runtime["response"]["body"]["error"]["type"] == "invalid_request_error"


def test_limits_and_bad_requests_are_clear_4xx(gw):
    client = client_of(gw)
    f = upload(client, jsonl([line("a", "/v1/completions", {"prompt": "x"})]))
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                              completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                              completion_window="1h")
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    # 50 MB on one line: refused for its line, never held whole
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("big.jsonl", b"x" * (50 << 20)), purpose="batch")
    assert e.value.body["code"] == "line_too_long"
    assert "big.jsonl" not in {x.filename for x in client.files.list().data}  # none stored


def test_a_tenant_sees_only_its_own_files_and_batches(gw):
    alice, bob = client_of(gw, "alice"), client_of(gw, "bob")
    f = upload(alice, jsonl([line("a", "/v1/completions", {"prompt": "x", "max_tokens": 1})]))
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                 completion_window="24h")
    for call in (lambda: bob.files.retrieve(f.id), lambda: bob.files.content(f.id),
                 lambda: bob.files.delete(f.id), lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "not_found_error"
    assert f.id not in [x.id for x in bob.files.list().data]
    assert batch.id not in [b.id for b in bob.batches.list().data]
    assert wait_for(alice, batch.id).status == "completed"
    assert alice.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(f.id)


def test_cancel_while_lines_run_ends_each_line_once_and_leaks_nothing(gw):
    client = client_of(gw)
    lines = [line(f"l{i}", "/v1/completions", {"prompt": f"Go {i}", "max_tokens": 60})
             for i in range(80)]
    f = upload(client, jsonl(lines))
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 5:
        time.sleep(0.05)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_for(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    out, errors = contents(client, batch)
    ended = [e["custom_id"] for e in errors]
    assert sorted(list(out) + ended) == sorted(f"l{i}" for i in range(80))  # each line once
    assert len(out) >= 5 and all(e["error"]["code"] == "batch_cancelled" for e in errors)
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again: as is
    deadline = time.monotonic() + 10
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting",
             "inferstack:budget_reserved_usd", "vllm:kv_cache_usage_perc")
    while time.monotonic() < deadline:
        m = gw.metrics(names)
        # the reservations' float sum returns to zero within its rounding (float64 sums of
        # dollar amounts around 1e-4: a few ulps of them)
        if not any(abs(v) > 1e-15 for v in m.values()):
            break
        time.sleep(0.2)
    assert not any(abs(v) > 1e-15 for v in m.values()), m


def test_open_batches_per_tenant_are_limited(gw):
    client = client_of(gw, "bob")
    slow = [line(f"s{i}", "/v1/completions", {"prompt": "x", "max_tokens": 200})
            for i in range(40)]
    f = upload(client, jsonl(slow))
    ids = [client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                 completion_window="24h").id for _ in range(3)]
    with pytest.raises(openai.RateLimitError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                              completion_window="24h")
    assert e.value.body["code"] == "too_many_open_batches"
    listed = client.batches.list(limit=2)
    assert [b.id for b in listed.data] == ids[::-1][:2] and listed.has_more
    for bid in ids:
        client.batches.cancel(bid)
    assert {wait_for(client, bid).status for bid in ids} == {"cancelled"}


def test_a_line_refused_for_budget_is_in_the_error_file_with_that_error(gw):
    client = client_of(gw, "poor")
    batch, out, errors = run_batch(client, "/v1/completions", [
        line(f"x{i}", "/v1/completions", {"prompt": "x", "max_tokens": 5}) for i in range(2)])
    assert batch.status == "completed" and out == {} and len(errors) == 2
    assert {e["response"]["status_code"] for e in errors} == {402}
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"insufficient_quota"}


def test_a_file_with_no_line_that_can_run_fails_the_batch(gw):
    client = client_of(gw)
    f = upload(client, b"not json\n" + jsonl([line("x", "/v1/chat/completions", {})]))
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")
    batch = wait_for(client, batch.id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [("invalid_json_line", 1),
                                                             ("mismatched_url", 2)]
    assert batch.output_file_id is None and batch.error_file_id is None


def test_cancel_at_once_and_twice_races_validation_cleanly(gw):
    client = client_of(gw)
    ids = [f"r{i}" for i in range(20)]
    f = upload(client, jsonl([line(c, "/v1/completions", {"prompt": c, "max_tokens": 30})
                              for c in ids]))
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                  completion_window="24h")
    first, second = client.batches.cancel(batch.id), client.batches.cancel(batch.id)
    assert {first.status, second.status} <= {"cancelling", "cancelled"}
    batch = wait_for(client, batch.id)
    assert batch.status == "cancelled"
    out, errors = contents(client, batch)
    ended = list(out) + [e["custom_id"] for e in errors]
    assert len(ended) == len(set(ended)) and set(ended) <= set(ids)  # none twice
    # cancelled while validating: no line was read; after it: every line accounted for
    assert batch.request_counts.total in (0, 20) and len(ended) == batch.request_counts.total
