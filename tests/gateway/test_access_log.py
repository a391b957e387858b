"""The access log and the throughput summary, read from a real fake-engine gateway's stderr:
one line per request (refusals included, with the tenant when known), text or JSON, none
with --no-access-log, and a summary line after a window with traffic."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from gateway.config import load_config
from testkit.gateway_server import GatewayProcess, free_port
from tests.gateway.keyfile import write_key_file

TENANTS = {"acme": {}, "ops": {}}
KEYS = [("sk-acme", "acme", False, False), ("sk-ops", "ops", True, False)]
ACME = {"Authorization": "Bearer sk-acme"}
LINE = re.compile(r"gateway\.access: (\S+) (\S+) (\d+) (.*)$")


class LoggedGateway(GatewayProcess):
    """A GatewayProcess whose stderr goes to a file the test reads."""

    def __init__(self, tmp_path, *flags: str):
        self.stderr_path = tmp_path / "gateway.stderr"
        self._err = open(self.stderr_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--port", str(self.port), "--fake",
             "--ledger-path", str(tmp_path / "ledger.sqlite3"), *flags],
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
            stderr=self._err, start_new_session=True)
        self.wait_ready(120)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stop(self) -> None:
        super().stop()
        self._err.close()


def request(url: str, body: dict | None = None, headers: dict | None = None,
            method: str = "POST") -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def access_lines(text: str, path: str) -> list[tuple[str, int, dict]]:
    """(method, status, fields) of the text access lines for `path`."""
    out = []
    for line in text.splitlines():
        m = LINE.search(line)
        if m and m.group(2) == path:
            fields = dict(kv.split("=", 1) for kv in m.group(4).split())
            out.append((m.group(1), int(m.group(3)), fields))
    return out


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def test_settings_default_and_flags():
    config = load_config([], environ={})
    assert (config.access_log, config.log_format, config.log_summary_seconds) == (True, "text",
                                                                                   10.0)
    config = load_config(["--no-access-log", "--log-format", "json",
                          "--log-summary-seconds", "0"], environ={})
    assert (config.access_log, config.log_format, config.log_summary_seconds) == (False, "json",
                                                                                   0.0)


@pytest.fixture
def keys_file(tmp_path):
    return write_key_file(tmp_path / "keys.toml", TENANTS, KEYS)


def test_each_request_leaves_one_text_line_with_its_fields(tmp_path, keys_file):
    gw = LoggedGateway(tmp_path, "--keys-file", keys_file, "--log-summary-seconds", "0.5")
    try:
        comp = gw.url + "/v1/completions"
        assert request(comp, {"prompt": "hello there", "max_tokens": 4}, ACME) == 200
        assert request(comp, {"prompt": 1}, ACME) == 400  # a bad body: tenant known
        assert request(comp, {"prompt": "hi"}) == 401  # no key: tenant unknown
        assert request(gw.url + "/no/such/route", None, ACME, "GET") == 404
        assert request(comp, {"prompt": "hi", "model": "nope"}, ACME) == 404

        def complete():
            lines = access_lines(gw.stderr(), "/v1/completions")
            return lines if len(lines) >= 4 else None
        lines = wait_for(complete)
        by_status: dict[int, list[dict]] = {}
        for method, status, fields in lines:
            assert method == "POST"
            by_status.setdefault(status, []).append(fields)
        assert sorted((s, len(f)) for s, f in by_status.items()) == [(200, 1), (400, 1),
                                                                      (401, 1), (404, 1)]
        ok = by_status[200][0]
        assert ok["tenant"] == "acme"
        assert int(ok["prompt"]) > 0 and int(ok["output"]) == 4 and int(ok["cached"]) >= 0
        assert 0 < float(ok["ttft_ms"]) <= float(ok["ms"])
        bad = by_status[400][0]
        assert bad["tenant"] == "acme" and bad["prompt"] == "-" and bad["ttft_ms"] == "-"
        assert by_status[401][0]["tenant"] == "-"
        assert by_status[404][0]["tenant"] == "acme"  # a model it may not use
        unrouted = access_lines(gw.stderr(), "/no/such/route")
        assert [(m, s) for m, s, _ in unrouted] == [("GET", 404)]
        assert unrouted[0][2]["tenant"] == "acme" and float(unrouted[0][2]["ms"]) >= 0
        summary = wait_for(lambda: re.search(
            r"gateway\.summary: summary req/s=(\S+) gen/s=(\S+) out_tok/s=(\S+) queue=(\d+) "
            r"running=\d+ kv=\S+ cache_hit=\S+", gw.stderr()), timeout=5)
        assert summary, gw.stderr()[-2000:]
    finally:
        gw.stop()


def test_json_lines_parse(tmp_path):
    gw = LoggedGateway(tmp_path, "--log-format", "json", "--log-summary-seconds", "0.5")
    try:
        assert request(gw.url + "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}) == 200
        assert request(gw.url + "/v1/completions", {"prompt": 1}) == 400

        def objects():
            found = []
            for line in gw.stderr().splitlines():
                if line.startswith("{"):
                    found.append(json.loads(line))
            kinds = {o["type"] for o in found}
            return found if {"access", "summary"} <= kinds and sum(
                o.get("path", "").startswith("/v1/") for o in found) >= 2 else None
        found = wait_for(objects)
        assert found, gw.stderr()[-2000:]
        chat = [o for o in found if o.get("path") == "/v1/chat/completions"]
        assert len(chat) == 1
        assert chat[0]["method"] == "POST" and chat[0]["status"] == 200
        assert chat[0]["tenant"] == "default" and chat[0]["output"] == 3
        assert chat[0]["request_id"] and chat[0]["ttft_ms"] > 0
        bad = [o for o in found if o.get("path") == "/v1/completions"]
        assert [(o["status"], o["output"]) for o in bad] == [(400, None)]
        summary = next(o for o in found if o["type"] == "summary")
        assert summary["output_tokens_per_s"] > 0 and summary["queue"] == 0
        assert set(summary) >= {"requests_per_s", "kv_use", "cache_hit_rate"}
    finally:
        gw.stop()


def test_no_access_log_logs_no_request(tmp_path):
    gw = LoggedGateway(tmp_path, "--no-access-log", "--log-summary-seconds", "0")
    try:
        assert request(gw.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2}) == 200
        assert request(gw.url + "/v1/completions", {"prompt": 1}) == 400
        time.sleep(0.5)
        text = gw.stderr()
        assert "gateway.access" not in text and "gateway.summary" not in text
        assert "listening on" in text  # the rest of the log is still there
    finally:
        gw.stop()


def test_an_unknown_log_format_stops_the_start():
    import pytest

    from gateway.config import load_config
    with pytest.raises(SystemExit, match="--log-format takes text or json"):
        load_config(["--log-format", "xml"], environ={})
