"""One small batch on the real SmolLM2 model: its greedy answers equal the same requests sent
online, chat and completions lines alike."""
from __future__ import annotations

import openai
import pytest

from testkit.gateway_server import GatewayProcess
from tests.gateway.batch_helpers import line, run_batch

MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.model

QUESTIONS = ["What is the capital of France?", "Name a primary colour.",
             "What is two plus two?"]


def test_a_small_batch_answers_as_online_greedy(tmp_path):
    gw = GatewayProcess("--kv-cache-gb", "0.25", "--max-num-seqs", "8",
                        "--ledger-path", str(tmp_path / "ledger.sqlite3"))
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        bodies = [{"model": MODEL, "messages": [{"role": "user", "content": q}],
                   "max_tokens": 24, "temperature": 0} for q in QUESTIONS]
        online = [client.chat.completions.create(**b).choices[0].message.content
                  for b in bodies]
        batch, out, errors = run_batch(client, "/v1/chat/completions", [
            line(f"q{i}", "/v1/chat/completions", b) for i, b in enumerate(bodies)],
            timeout=120)
        assert batch.status == "completed" and not errors
        assert [out[f"q{i}"]["response"]["body"]["choices"][0]["message"]["content"]
                for i in range(len(bodies))] == online
        assert "Paris" in online[0]
        prompt = {"model": MODEL, "prompt": "The first three months are", "max_tokens": 16,
                  "temperature": 0}
        want = client.completions.create(**prompt).choices[0].text
        batch, out, errors = run_batch(client, "/v1/completions",
                                       [line("p", "/v1/completions", prompt)], timeout=120)
        assert out["p"]["response"]["body"]["choices"][0]["text"] == want
    finally:
        gw.stop()
