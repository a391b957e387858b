"""Resident memory of a loaded engine against its GGUF file's size (issue 31: at most 1.2x the
file + the KV pool + 400 MB).

Each run is a fresh process (`python -m bench.memory --child ...`) that loads the model with
the given KV pool and quantization, generates a few tokens (so every weight has been read
once: a mapped file's pages count once touched), and reports /proc/self/status's VmRSS (and
its anonymous and file-backed parts) and VmHWM. `--before DIR` runs the same child with
PYTHONPATH=DIR from DIR (a `git archive <commit> | tar -x -C DIR` checkout): the code before,
on the same file and machine.

    python -m bench.memory                                   # SmolLM2, this tree
    python -m bench.memory --model FILE.gguf --kv-cache-gb 0.25 --before /tmp/before
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MIB = 1 << 20


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def child(model: str | None, kv_gb: float, quantization: str) -> dict:
    from contract.config import EngineConfig
    from contract.sampling_params import SamplingParams
    from runtime.engine import LLMEngine
    from runtime.loading.loader import default_model_path, load_checkpoint

    path = model or default_model_path()
    start = time.perf_counter()
    engine = LLMEngine(load_checkpoint(path),
                       EngineConfig(kv_cache_bytes=int(kv_gb * (1 << 30)),
                                    quantization=quantization))
    loaded = time.perf_counter() - start
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([list(range(3, 60))], params)  # every weight read once
    # each cache tensor once: latent attention's K and V are one tensor (runtime/models/mla.py)
    caches = {t.data_ptr(): t for pair in engine.runner.kv_caches for t in pair}
    kv = sum(t.numel() * t.element_size() for t in caches.values())
    return {"file": os.path.getsize(path), "kv": kv, "load_s": loaded,
            "quantization": engine.runner.model.quantization, **_status()}


def run(root: str | None, model: str | None, kv_gb: float, quantization: str) -> dict:
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    # this file run as a script: the tree measured is the one on PYTHONPATH (a checkout of
    # the code before need not have this file)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--kv-cache-gb", str(kv_gb),
           "--quantization", quantization] + (["--model", model] if model else [])
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2)")
    ap.add_argument("--kv-cache-gb", type=float, default=0.0625)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--before", default=None, help="a checkout of the code before")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # run as a script: its folder (bench/, with a kernels.py) leaves the path
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        print(json.dumps(child(args.model, args.kv_cache_gb, args.quantization)))
        return
    rows = [("before", args.before)] if args.before else []
    rows.append(("after", None))
    print("| code | file MiB | KV MiB | RSS MiB (anon + file) | peak MiB | target MiB | "
          "RSS / target |")
    print("|---|---|---|---|---|---|---|")
    for name, root in rows:
        r = run(root, args.model, args.kv_cache_gb, args.quantization)
        target = 1.2 * r["file"] + r["kv"] + 400e6
        print(f"| {name} ({r['quantization']}) | {r['file'] / MIB:.0f} | {r['kv'] / MIB:.0f} | "
              f"{r['VmRSS'] / MIB:.0f} ({r['RssAnon'] / MIB:.0f} + {r['RssFile'] / MIB:.0f}) | "
              f"{r['VmHWM'] / MIB:.0f} | {target / MIB:.0f} | {r['VmRSS'] / target:.2f} |")


if __name__ == "__main__":
    main()
