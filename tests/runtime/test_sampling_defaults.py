"""Sampling defaults: where a model's come from, `--sampling-defaults`, and that they fill only
the fields a request omits."""
from __future__ import annotations

import json

import gguf
import pytest

from contract.errors import ModelLoadError
from contract.model_files import default_model_path
from contract.sampling_defaults import GGUF_PROFILE, PROFILES, SamplingSpec, parse_spec
from gateway.openai.requests import parse_chat_request, parse_completion_request
from runtime.loading.sampling_defaults import model_sampling_defaults


def write_gguf(path, **sampling) -> str:
    """A GGUF file with metadata only (no tensors): enough for the sampling keys."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in sampling.items():
        name = f"general.sampling.{key}"
        if isinstance(value, int):
            writer.add_int32(name, value)
        else:
            writer.add_float32(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_hf_folder_gives_its_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "bos_token_id": 1,
         "repetition_penalty": 1.1}))
    assert model_sampling_defaults(str(tmp_path)) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}


def test_a_hf_folder_without_generation_config_gets_openai_defaults(tmp_path):
    assert model_sampling_defaults(str(tmp_path)) == {}


def test_an_invalid_generation_config_is_a_load_error_naming_the_folder(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 3.0}))
    with pytest.raises(ModelLoadError, match="top_p"):
        model_sampling_defaults(str(tmp_path))


def test_a_gguf_with_sampling_metadata_gives_it(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", temp=0.7, top_k=30, top_p=0.8, min_p=0.02)
    got = model_sampling_defaults(path)
    assert got == pytest.approx({"temperature": 0.7, "top_k": 30, "top_p": 0.8, "min_p": 0.02})
    assert isinstance(got["top_k"], int)


def test_the_shipped_gguf_names_none_and_gets_the_documented_profile():
    assert model_sampling_defaults(default_model_path()) == PROFILES[GGUF_PROFILE]


@pytest.mark.parametrize("text, base, overrides", [
    (None, "model", {}), ("", "model", {}), ("model", "model", {}), ("none", "openai", {}),
    ("llama-cpp", "llama-cpp", {}), ("top_k=5", "model", {"top_k": 5}),
    ("llama-cpp, temperature=0.6", "llama-cpp", {"temperature": 0.6}),
])
def test_spec_parses(text, base, overrides):
    assert parse_spec(text) == SamplingSpec(base, overrides)


@pytest.mark.parametrize("text, why", [
    ("creative", "unknown sampling profile"), ("top_p=2", "top_p"), ("seed=3", "not a sampling"),
    ("temperature=hot", "not a number"), ("top_k=1.5", "not a number"),
])
def test_bad_specs_say_why(text, why):
    with pytest.raises(ValueError, match=why):
        parse_spec(text)


def test_resolve_layers_overrides_on_the_base():
    model = {"temperature": 0.3, "top_p": 0.9}
    assert parse_spec("top_k=7").resolve(model) == {"temperature": 0.3, "top_p": 0.9, "top_k": 7}
    assert parse_spec("none").resolve(model) == {}
    assert parse_spec("llama-cpp,min_p=0.1").resolve(model) == {
        **PROFILES["llama-cpp"], "min_p": 0.1}


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_defaults_fill_only_the_omitted_fields():
    defaults = {"temperature": 0.0, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                "repetition_penalty": 1.1}
    omitted = parse_chat_request(CHAT, defaults).sampling_params(16)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.min_p,
            omitted.repetition_penalty) == (0.0, 0.9, 40, 0.05, 1.1)
    # sent at OpenAI's own default values: taken as sent, not replaced
    sent = parse_chat_request({**CHAT, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                               "min_p": 0.0, "repetition_penalty": 1.0}, defaults
                              ).sampling_params(16)
    assert (sent.temperature, sent.top_p, sent.top_k, sent.min_p,
            sent.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    # null is the same as omitted, as in OpenAI's API
    assert parse_chat_request({**CHAT, "temperature": None}, defaults
                              ).sampling["temperature"] == 0.0
    completion = parse_completion_request({"prompt": "x"}, defaults).sampling
    assert completion["top_k"] == 40


def test_without_defaults_a_request_gets_openais():
    params = parse_chat_request(CHAT).sampling_params(16)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
