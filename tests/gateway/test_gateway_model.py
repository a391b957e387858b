"""End to end on the real SmolLM2 model through the official openai client."""
import pytest

from testkit.gateway_server import GatewayProcess

MODEL = "SmolLM2-135M-Instruct"  # the model file's name: what the gateway serves it as

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gw():
    server = GatewayProcess("--kv-cache-gb", "0.25", "--max-num-seqs", "8")
    yield server
    server.stop()


def test_chat_answer_mentions_paris(gw):
    import openai
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=question, max_tokens=40,
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.prompt_tokens > 20

    stream = client.chat.completions.create(model=MODEL, messages=question, max_tokens=40,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: the same answer streamed
    usage = chunks[-1].usage
    # the second request re-sent the same prompt: its full blocks came from the prefix cache
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


def test_logprobs_and_seeded_sampling(gw):
    import openai
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL, prompt="The three primary colours are", max_tokens=8,
                  temperature=0.9, seed=11, logprobs=2)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == 8 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) >= 1 for t in lp.top_logprobs)


def readme_quick_start_body() -> dict:
    """The JSON body of the README's first curl, exactly as a newcomer would send it."""
    import json
    import pathlib
    import re
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return json.loads(re.search(r"-d '(\{.*?\})'", quick_start, re.S).group(1))


def test_the_readme_quick_start_answers_sensibly(gw):
    """No sampling fields in the body: the model's defaults apply, and the answer is right."""
    import json

    import requests
    body = readme_quick_start_body()
    assert not {"temperature", "top_p", "top_k", "min_p", "seed"} & set(body)
    with requests.post(gw.url + "/v1/chat/completions", json=body, stream=True,
                       timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events if json.loads(e)["choices"])
    assert "Paris" in text, text
