"""The engine's side of --max-model-len, --chat-template and --device: a context over the
model's own, a CUDA device this process cannot see and a template that cannot be read are
StartErrors (one line, before any request); a shorter context caps requests; the template
replaces the model's in the tokenizer the engine gives its gateways (the Ready frame)."""
from __future__ import annotations

import pytest
import torch

from contract.config import EngineConfig
from contract.errors import PromptTooLongError, StartError
from contract.sampling_params import SamplingParams
from contract.tokenizer import Tokenizer
from runtime.engine import LLMEngine
from runtime.transport.worker import Worker

PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Paris is the capital of France"}]


def test_a_context_over_the_models_is_refused(make_tiny_engine, tiny_checkpoint):
    model_context = tiny_checkpoint.config.max_position_embeddings
    with pytest.raises(StartError, match=f"--max-model-len {model_context + 1} exceeds the "
                                         f"context of .* \\({model_context} tokens\\)"):
        make_tiny_engine(max_model_len=model_context + 1)
    assert make_tiny_engine(max_model_len=model_context).max_model_len == model_context
    assert make_tiny_engine().max_model_len == model_context


def test_a_shorter_context_caps_requests(make_tiny_engine):
    engine = make_tiny_engine(max_model_len=32)
    assert engine.info()["max_model_len"] == 32
    with pytest.raises(PromptTooLongError):
        engine.add_request("long", list(range(5, 45)), SamplingParams(max_tokens=1))
    engine.add_request("short", list(range(5, 15)), SamplingParams(max_tokens=4))


def test_the_chat_template_reaches_the_gateway_through_ready(make_tiny_engine, tiny_checkpoint):
    engine = make_tiny_engine(chat_template=PLAIN_TEMPLATE)
    assert tiny_checkpoint.tokenizer.chat_template != PLAIN_TEMPLATE  # the model's is untouched
    gateway_side = Tokenizer.from_json(Worker(engine).ready_message().tokenizer)
    assert gateway_side.apply_chat_template(MESSAGES) == MESSAGES[0]["content"]


def test_a_template_file_that_is_missing_is_a_start_error(make_tiny_engine, tmp_path):
    with pytest.raises(StartError, match="--chat-template .*missing.jinja: cannot read it"):
        make_tiny_engine(chat_template=str(tmp_path / "missing.jinja"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cuda_without_a_gpu_is_a_start_error_before_the_load(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the device was checked")
    monkeypatch.setattr("runtime.engine.load_checkpoint", no_load)
    with pytest.raises(StartError, match="--device cuda: torch .* use --device cpu"):
        LLMEngine.from_model_path("unused", EngineConfig(device="cuda"))
