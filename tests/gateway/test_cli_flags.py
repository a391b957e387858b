"""The flags a vLLM user reaches for first, with vLLM's names and meanings, and a --help that
names each default once.

--max-model-len caps the context (requests over it get 400, the model cards report it) and may
not exceed the model's own; --chat-template FILE (or the template text itself) replaces the
model's template, in the worker's engine, so the gateway tokenizes chats with it (/tokenize and
a completion's usage agree). The settings are declared once (contract/engine_settings.py): the
gateway and the worker parse the same names, and one rule (`with_default`) writes the defaults
into both helps.
"""
from __future__ import annotations

import argparse
import json
import re
import urllib.request

import pytest

from contract.engine_settings import EngineSettings, torch_build_has_gpu, with_default
from contract.errors import StartError
from contract.tokenizer import load_chat_template
from gateway.config import build_parser, debug_requested, listen_problem, load_config
from runtime.transport.worker import build_parser as worker_parser
from testkit.gateway_server import GatewayProcess

# renders the messages' contents alone: no role markers, so a chat tokenizes as its text does
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    formatter = parser._get_formatter()
    return {action.dest: formatter._expand_help(action) for action in parser._actions
            if action.help and action.help is not argparse.SUPPRESS}


@pytest.mark.parametrize("parser", [build_parser(), worker_parser()], ids=["gateway", "worker"])
def test_no_help_names_a_default_twice(parser):
    for dest, text in _helps(parser).items():
        named = re.findall(r"\(default\b|\bby default\b", text)
        assert len(named) <= 1, f"--{dest}: {text}"
        assert "(default: None)" not in text and "(default: ())" not in text, f"--{dest}"


def test_the_helps_name_the_declared_defaults():
    gateway, worker = _helps(build_parser()), _helps(worker_parser())
    assert gateway["port"].endswith("(default: 8000)")
    assert gateway["max_num_seqs"] == worker["max_num_seqs"]
    assert gateway["max_model_len"].endswith("(default: the model's context)")
    assert gateway["telemetry"].endswith("(default: True)")


def test_auto_quantization_is_described_as_resolve_serves_it():
    """runtime/loading/quantization.resolve: int4 for a 4-bit GGUF where the compiled CPU
    kernels run, else int8, float elsewhere."""
    text = _helps(build_parser())["quantization"]
    assert "int4 for a 4-bit file" in text and "else int8" in text


def test_with_default_is_the_one_rule():
    assert with_default("TCP port", 8000) == "TCP port (default: 8000)"
    assert with_default("a folder", None) == "a folder"
    assert with_default("budget (default: rest of context)", 0) == \
        "budget (default: rest of context)"


def test_both_new_settings_reach_the_worker():
    config = load_config(["--max-model-len", "2048", "--chat-template", "chat.jinja"],
                         environ={})
    assert config.engine == EngineSettings(max_model_len=2048, chat_template="chat.jinja")
    argv = config.worker_argv()
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    assert argv[argv.index("--chat-template") + 1] == "chat.jinja"
    assert "--max-model-len" not in load_config([], environ={}).worker_argv()  # unset: none


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(PLAIN_TEMPLATE)
    assert load_chat_template(str(path)) == PLAIN_TEMPLATE
    assert load_chat_template(PLAIN_TEMPLATE) == PLAIN_TEMPLATE  # braces: the text itself
    assert load_chat_template(None) is None
    with pytest.raises(StartError, match="cannot read it"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(StartError, match="does not compile"):
        load_chat_template("{% if x %}")


def test_debug_is_read_before_the_settings():
    assert debug_requested(["--port", "abc", "--debug"], environ={})
    assert not debug_requested(["--debug", "--no-debug"], environ={})
    assert debug_requested([], environ={"INFERSTACK_DEBUG": "1"})
    assert not debug_requested([], environ={})


def test_listen_problems_name_the_flag_to_change():
    import errno
    import socket
    used = OSError(errno.EADDRINUSE, "address already in use")
    assert listen_problem("127.0.0.1", 8000, used) == \
        "cannot listen on 127.0.0.1:8000: address already in use (another server? choose --port)"
    assert "choose --port" in listen_problem("0.0.0.0", 80, OSError(errno.EACCES, "denied"))
    assert "choose --host" in listen_problem("nohost", 1, socket.gaierror(-2, "Name unknown"))


def test_the_torch_build_is_read_without_importing_torch():
    import torch
    assert torch_build_has_gpu() == (torch.version.cuda is not None
                                     or torch.version.hip is not None)


# ---- a real gateway over the tiny model ----------------------------------------------------

def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def tiny_gateway(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("flags")
    template = folder / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    server = GatewayProcess("--model", str(tiny_model_dir), "--max-model-len", "64",
                            "--chat-template", str(template), "--kv-cache-gb", "0.05",
                            "--ledger-path", str(folder / "ledger.sqlite3"))
    yield server
    server.stop()


def test_max_model_len_is_reported_and_enforced(tiny_gateway):
    status, body = tiny_gateway.get("/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == 64
    long_prompt = list(range(5, 75))  # 70 token ids: over the context of 64
    status, answer = _post(tiny_gateway.url, "/v1/completions",
                           {"prompt": long_prompt, "max_tokens": 1})
    assert status == 400, answer
    status, answer = _post(tiny_gateway.url, "/v1/completions",
                           {"prompt": list(range(5, 15)), "max_tokens": 60})
    assert status == 400 and "at most 54 fit" in answer["error"]["message"], answer
    status, answer = _post(tiny_gateway.url, "/v1/completions",
                           {"prompt": list(range(5, 15)), "max_tokens": 4})
    assert status == 200, answer


def test_the_chat_template_replaces_the_models(tiny_gateway):
    """The model's template wraps each turn in <|im_start|>role ... <|im_end|>; the given one
    renders the contents alone, so the chat is tokenized exactly as its text is."""
    messages = [{"role": "user", "content": "The quick brown fox"}]
    status, chat = _post(tiny_gateway.url, "/tokenize", {"messages": messages})
    assert status == 200, chat
    status, text = _post(tiny_gateway.url, "/tokenize", {"prompt": "The quick brown fox"})
    assert status == 200 and chat["tokens"] == text["tokens"], (chat, text)
    status, answer = _post(tiny_gateway.url, "/v1/chat/completions",
                           {"messages": messages, "max_tokens": 1})
    assert status == 200 and answer["usage"]["prompt_tokens"] == chat["count"], answer
