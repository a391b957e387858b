"""Start-up: the progress lines, the KV cache's lazily zeroed memory, the provisional crossover
table of a busy machine, and the float32 weight cache of earlier versions removed."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from contract.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.execution.runner import lazily_zeroed
from runtime.loading import progress
from runtime.loading.calibration import Calibration
from runtime.loading.loader import load_checkpoint
from runtime.loading.quantization import Int8Weight
from tests.runtime.test_gguf_blocks import ALL_Q4_1, write_gguf


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("startup") / "tiny.Q4_1.gguf")
    write_gguf(path, ALL_Q4_1)
    return path


def test_each_stage_is_logged(gguf_path, caplog):
    caplog.set_level(logging.INFO, logger=progress.LOGGER)
    LLMEngine.from_model_path(gguf_path, EngineConfig(num_blocks=32, block_size=4,
                                                      quantization="int4", quant_max_rows=8))
    progress.log_ready()
    lines = [r.getMessage() for r in caplog.records if r.name == progress.LOGGER]
    starts = ["loading tiny.Q4_1.gguf (", "header and tokenizer read in ", "model built in ",
              "KV cache: 32 blocks (128 tokens, ", "ready in "]
    assert [next((i for i, line in enumerate(lines) if line.startswith(s)), None)
            for s in starts] == sorted(range(len(starts))), lines
    assert "tensors Q4_1 14, F32 5, Q8_0 1" in lines[1]
    built = next(line for line in lines if line.startswith("model built"))
    assert ("int4 (file blocks) 8, int8-block (file blocks) 1" in built
            if "file blocks" in built else "int8 " in built)  # without the C kernels: int8


def test_process_seconds_counts_from_the_process_start():
    assert 0 < progress.process_seconds() < 24 * 3600


def test_show_on_stderr_prints_the_runtime_lines_once(monkeypatch, capsys):
    runtime = logging.getLogger("runtime")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(runtime, "handlers", [])
    monkeypatch.setattr(runtime, "level", logging.NOTSET)
    progress.show_on_stderr()
    progress.show_on_stderr()  # configured: nothing added
    logging.getLogger(progress.LOGGER).info("stage in 0.1 s")
    assert capsys.readouterr().err == "[stage in 0.1 s]\n" and len(runtime.handlers) == 1


def test_the_kv_cache_is_zero_and_lazily_mapped():
    kv = lazily_zeroed((3, 2, 8, 2, 4), torch.float16)
    assert kv.shape == (3, 2, 8, 2, 4) and kv.is_contiguous() and not bool(kv.any())
    kv[1, 0] += 1  # writable, and each layer's K and V are separate views
    assert float(kv.sum()) == 64 and not bool(kv[1, 1].any())


def test_engine_caches_are_views_of_one_zeroed_allocation(gguf_path):
    engine = LLMEngine.from_model_path(gguf_path, EngineConfig(num_blocks=16, block_size=4))
    caches = engine.runner.kv_caches
    k, v = caches[0]
    assert k.shape == ((16 + 1) * 4, 2, 16) and k.dtype == engine.runner.kv_dtype
    assert v.data_ptr() - k.data_ptr() == k.numel() * k.element_size()
    assert all(not bool(k.any()) and not bool(v.any()) for k, v in caches)


# ---- the crossover table of a busy machine -------------------------------------------------
def _weight():
    w = Int8Weight(torch.randn(64, 64))
    return w.dequantized(), w


def test_a_busy_measurement_is_kept_as_provisional(tmp_path, monkeypatch):
    busy = [True]
    monkeypatch.setattr("runtime.loading.calibration.machine_busy", lambda: busy[0])
    monkeypatch.setattr("runtime.loading.calibration.measure", lambda packed, weight: 7)
    first = Calibration(str(tmp_path))
    assert first.max_quant_rows("int8", *_weight()) == 7 and first.measured == 1
    first.save()
    assert first.saved_as == "provisional"
    assert not (tmp_path / "linear-crossover.json").exists()  # never the settled table
    again = Calibration(str(tmp_path))  # busy again: the provisional value, nothing measured
    assert again.max_quant_rows("int8", *_weight()) == 7
    assert again.measured == 0 and again.used_provisional == 1
    busy[0] = False  # a quiet start measures it afresh and settles it
    monkeypatch.setattr("runtime.loading.calibration.measure", lambda packed, weight: 9)
    quiet = Calibration(str(tmp_path))
    assert quiet.max_quant_rows("int8", *_weight()) == 9 and quiet.measured == 1
    quiet.save()
    assert quiet.saved_as == "settled"
    final = Calibration(str(tmp_path))
    assert final.provisional == {} and list(final.table.values()) == [9]


# ---- the weight cache of earlier versions ---------------------------------------------------
def test_the_old_float32_weight_cache_is_removed(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSTACK_CACHE_DIR", str(tmp_path))
    old = tmp_path / "tiny.Q4_1-0123456789abcdef01234567.safetensors"
    keep = [tmp_path / "linear-crossover.json", tmp_path / "other-0123456789abcdef01234567"
            ".safetensors", tmp_path / "tiny.Q4_1-notahash.safetensors"]
    for path in [old, *keep]:
        path.write_bytes(b"x")
    load_checkpoint(gguf_path)
    assert not old.exists() and all(path.exists() for path in keep)
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in keep)
