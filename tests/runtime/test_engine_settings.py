"""One declaration of the engine settings (contract/engine_settings.py): the gateway's config,
the worker's flags and the EngineConfig a worker builds agree on every default, and whatever the
gateway is told reaches the worker's EngineConfig unchanged. No model is loaded: the engine
constructors are replaced by ones that hand back what they were given."""
from __future__ import annotations

from dataclasses import fields

import pytest

from contract.config import EngineConfig
from contract.engine_settings import EngineSettings
from gateway.config import GatewayConfig, build_parser, load_config
from runtime.transport.worker import build_engine, parse_args

SETTINGS = fields(EngineSettings)

# A value off the default for every setting, and the EngineConfig fields it must become.
NON_DEFAULT = {"device": "cuda", "kv_cache_gb": 0.5, "max_num_seqs": 8,
               "max_num_batched_tokens": 256, "prefix_caching": False,
               "disk_cache_dir": "/tmp/kv-disk", "spec": "self:2", "num_spec_tokens": 3,
               "quantization": "int4", "thread_policy": "fixed", "overlap": "on",
               "kv_cache_dtype": "float32", "max_model_len": 1024, "itl_target_ms": 60.0,
               "chat_template": "{{ messages[0]['content'] }}"}
NON_DEFAULT_ENGINE = EngineConfig(device="cuda", kv_cache_bytes=1 << 29, max_num_seqs=8,
                                  max_num_batched_tokens=256, enable_prefix_caching=False,
                                  disk_cache_dir="/tmp/kv-disk", spec="self:2",
                                  num_spec_tokens=3, quantization="int4",
                                  thread_policy="fixed", overlap="on",
                                  kv_cache_dtype="float32", max_model_len=1024,
                                  itl_target_ms=60.0,
                                  chat_template="{{ messages[0]['content'] }}")


@pytest.fixture
def engine_of(monkeypatch):
    """The EngineConfig (or fake-engine arguments) build_engine makes from a worker argv."""
    import torch

    from runtime import fake_engine
    from runtime.engine import LLMEngine
    monkeypatch.setattr(LLMEngine, "from_model_path",
                        classmethod(lambda cls, path, config: config))
    monkeypatch.setattr(fake_engine, "FakeEngine", lambda **kwargs: kwargs)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep this process's threads
    return lambda argv: build_engine(parse_args(argv))


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda f: f.name)
def test_one_default_everywhere(setting):
    assert getattr(GatewayConfig().engine, setting.name) == setting.default
    assert getattr(parse_args([]), setting.name) == setting.default
    # the gateway's flag leaves the value unset, so the default above is the one that applies
    assert getattr(build_parser().parse_args([]), setting.name) is None


def test_defaults_are_engine_config_defaults():
    assert EngineSettings().engine_config() == EngineConfig()


def test_default_gateway_gives_worker_default_engine_config(engine_of):
    assert engine_of(GatewayConfig().worker_argv()) == EngineConfig()


def test_non_default_gateway_flags_reach_engine_config(engine_of):
    config = load_config(["--max-num-seqs", "8", "--no-prefix-caching", "--spec", "ngram"],
                         environ={})
    assert engine_of(config.worker_argv()) == EngineConfig(
        max_num_seqs=8, enable_prefix_caching=False, spec="ngram")


def test_every_setting_travels(engine_of):
    assert set(NON_DEFAULT) == {f.name for f in SETTINGS}, "give each new setting a value here"
    config = GatewayConfig(EngineSettings(**NON_DEFAULT))
    assert engine_of(config.worker_argv()) == NON_DEFAULT_ENGINE


def test_every_setting_travels_from_the_environment(engine_of):
    environ = {"INFERSTACK_" + k.upper(): str(v) for k, v in NON_DEFAULT.items()}
    assert engine_of(load_config([], environ=environ).worker_argv()) == NON_DEFAULT_ENGINE


def test_worker_takes_every_flag_it_took_before(engine_of):
    args = parse_args(["--model", "m.gguf", "--device", "cuda", "--threads", "2",
                       "--kv-cache-gb", "0.5", "--max-num-seqs", "8",
                       "--max-num-batched-tokens", "256", "--no-prefix-caching",
                       "--disk-cache-dir", "/tmp/kv-disk", "--spec", "self:2",
                       "--num-spec-tokens", "3", "--quantization", "int4",
                       "--thread-policy", "fixed", "--overlap", "on",
                       "--kv-cache-dtype", "float32", "--max-model-len", "1024",
                       "--itl-target-ms", "60",
                       "--chat-template", "{{ messages[0]['content'] }}",
                       "--kv-store", "127.0.0.1:1", "--fake",
                       "--fake-step-ms", "5"])
    assert (args.model, args.threads, args.kv_store, args.fake, args.fake_step_ms) == (
        "m.gguf", 2, "127.0.0.1:1", True, 5.0)
    args.chat_template = None  # the fake engine would read the model's tokenizer to apply it
    assert build_engine(args) == {"step_seconds": 0.005, "max_num_seqs": 8, "num_blocks": 4096,
                                  "max_model_len": 1024}
    args.chat_template = "{{ messages[0]['content'] }}"
    args.fake = False
    assert build_engine(args) == NON_DEFAULT_ENGINE


def test_gateway_keeps_both_prefix_caching_switches():
    assert build_parser().parse_args(["--prefix-caching"]).prefix_caching is True
    assert load_config(["--no-prefix-caching"], environ={}).engine.prefix_caching is False


@pytest.mark.parametrize("argv,reason", [
    (["--kv-cache-dtype", "half"], "kv_cache_dtype must be one of auto, float32, float16"),
    (["--quantization", "int3"], "quantization must be one of auto, none, int8, int4"),
    (["--overlap", "sometimes"], "overlap must be one of auto, on, off"),
    (["--thread-policy", "greedy"], "thread_policy must be one of adaptive, fixed"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
])
def test_the_gateway_refuses_engine_settings_no_worker_could_start_with(argv, reason):
    with pytest.raises(SystemExit, match=reason):
        load_config(argv, environ={})
    with pytest.raises(SystemExit, match=reason):
        load_config([], environ={"INFERSTACK_" + argv[0][2:].replace("-", "_").upper(): argv[1]})
