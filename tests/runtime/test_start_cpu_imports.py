"""A CPU worker imports nothing it does not use: no triton (its kernels run on CUDA only;
importing it costs 0.1 s and leaves about 30 "nanobind: leaked" lines on every exit), no Ray,
no transformers. Checked in fresh processes over the real default model."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_ONLY = ("triton", "ray", "transformers")
BUILD_AND_STEP = f"""
import sys
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.engine import LLMEngine
engine = LLMEngine.from_model_path(None, EngineConfig(device="cpu"))
engine.generate([engine.tokenizer.encode("Hello")], SamplingParams(max_tokens=3))
print(sorted(m for m in {GPU_ONLY!r} if m in sys.modules))
"""


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("INFERSTACK_KERNELS", None)  # the default dispatch, as a worker has it
    return env


def test_a_cpu_engine_imports_no_gpu_only_package():
    done = subprocess.run([sys.executable, "-c", BUILD_AND_STEP], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_a_cpu_worker_exits_without_third_party_noise():
    """The pipe worker, its gateway gone at once (stdin empty): it loads, says ready in one
    log line on stderr, and exits 0 with nothing else there."""
    done = subprocess.run([sys.executable, "-m", "runtime.transport.worker"], cwd=ROOT,
                          env=_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=300)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 0, err
    assert "nanobind" not in err and "Traceback" not in err, err
    ready = [line for line in err.splitlines() if "runtime.transport.worker: worker pid" in line]
    assert len(ready) == 1 and " INFO " in ready[0], err
