"""A tiny DeepSeek-V3 (testkit/family_models.py: MLA over a latent cache, sigmoid router with
the correction bias in groups, a shared expert, a dense first layer) served from its Hugging
Face folder with `--model` through the real gateway, answering the official openai client:
streamed with usage, the repeated prompt's full blocks counted as cached tokens."""
from __future__ import annotations

import pytest

from testkit.family_models import write_family_checkpoint
from testkit.gateway_server import GatewayProcess

pytest.importorskip("transformers")
pytest.importorskip("openai")

BLOCK = 16  # the engine's default block size: a prefix hit counts whole blocks


@pytest.fixture(scope="module")
def deepseek_gateway(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek") / "tiny-deepseek-v3"
    write_family_checkpoint(folder, "deepseek_v3")
    server = GatewayProcess("--model", str(folder), "--kv-cache-gb", "0.05",
                            "--max-num-seqs", "4",
                            "--ledger-path", str(folder.parent / "ledger.sqlite3"))
    yield server
    server.stop()


def test_deepseek_v3_answers_the_official_client_streamed_with_cached_tokens(
        deepseek_gateway):
    import openai

    client = openai.OpenAI(base_url=deepseek_gateway.url + "/v1", api_key="unused",
                           max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me about latent attention and experts, "
                 "in a few words, please."}]
    kwargs = dict(model=model, messages=messages, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**kwargs)
    assert first.usage.completion_tokens == 12
    assert first.usage.prompt_tokens > BLOCK

    stream = client.chat.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and text == first.choices[0].message.content  # greedy: the same, streamed
    usage = chunks[-1].usage
    assert usage.prompt_tokens == first.usage.prompt_tokens
    assert usage.completion_tokens == 12
    # the same prompt again: its full blocks (all but the last token's) came from the
    # prefix cache, the latent KV blocks of MLA included
    assert usage.prompt_tokens_details.cached_tokens == \
        (usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
