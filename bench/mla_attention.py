"""Multi-head Latent Attention on the CPU (issue 32): one DeepSeek layer's attention with random
weights, the absorbed form we serve (the query multiplied into the latent space, one-KV-head
attention over the latent cache in the paged C kernels, each head's value projection after)
against the expanded form (the latent expanded to every head's K and V by kv_b_proj, then
SDPA) on the same chunk, side by side; and absorbed decode at a context. Shapes: DeepSeek-V2-Lite
(16 heads, hidden 2048, plain q_proj) and DeepSeek-V3 (128 heads, hidden 7168, q_lora 1536);
kv_lora_rank 512, rope 64, nope 128, v 128; a float16 latent cache; min of 3 calls.

    python -m bench.mla_attention
"""
from __future__ import annotations

import argparse
import os
import time
from functools import partial

import torch

from bench.common import REPO_ROOT, fmt, markdown_table, write_json
from contract.config import ModelConfig
from runtime.execution import step_inputs
from runtime.models.attention import AttentionMetadata, RotaryTable
from runtime.models.mla import LatentAttention, expanded_attention
from runtime.models.weights import LinearMaker, ModelWeights
from runtime.scheduling.output import ScheduledRequest

SHAPES = {"V2-Lite": (2048, 16, 0), "V3": (7168, 128, 1536)}  # hidden, heads, q_lora_rank
BLOCK = 16


def _config(hidden: int, heads: int, q_lora: int) -> ModelConfig:
    return ModelConfig(architecture="deepseek_v3", vocab_size=100, hidden_size=hidden,
                       intermediate_size=64, num_hidden_layers=1, num_attention_heads=heads,
                       num_key_value_heads=heads, max_position_embeddings=8192, head_dim=64,
                       kv_lora_rank=512, q_lora_rank=q_lora, qk_nope_head_dim=128,
                       qk_rope_head_dim=64, v_head_dim=128)


def _weights(c: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a, heads, hidden = "model.layers.0.self_attn.", c.num_attention_heads, c.hidden_size

    def rand(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    w = {a + "kv_a_proj_with_mqa.weight": rand(576, hidden),
         a + "kv_a_layernorm.weight": torch.ones(512),
         a + "kv_b_proj.weight": rand(heads * 256, 512),
         a + "o_proj.weight": rand(hidden, heads * 128)}
    if c.q_lora_rank:
        w[a + "q_a_proj.weight"] = rand(c.q_lora_rank, hidden)
        w[a + "q_a_layernorm.weight"] = torch.ones(c.q_lora_rank)
        w[a + "q_b_proj.weight"] = rand(heads * 192, c.q_lora_rank)
    else:
        w[a + "q_proj.weight"] = rand(heads * 192, hidden)
    return w


def _meta(start: int, n: int, rot: RotaryTable) -> AttentionMetadata:
    blocks = tuple(range(-(-(start + n) // BLOCK)))
    host = step_inputs.pack([ScheduledRequest("a", start, tuple(range(n)), blocks)], BLOCK)
    t = step_inputs.views(step_inputs.to_device(host.values, torch.device("cpu")), host.layout)
    return AttentionMetadata.build(t, host.layout, BLOCK, rot)


def _best(f, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mla_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default="16,64,256,512")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--json", default=str(REPO_ROOT / "bench" / "results" / "mla_attention.json"))
    a = p.parse_args(argv)
    load, rows, runs = os.getloadavg()[0], [], []
    cpu = torch.device("cpu")
    for name, shape in SHAPES.items():
        c = _config(*shape)
        mla = LatentAttention(c, ModelWeights(_weights(c), cpu, torch.float32),
                              "model.layers.0.self_attn.",
                              LinearMaker("none", torch.float32, None, None, cpu))
        rot = RotaryTable(8192, c, torch.float32, cpu)
        cache = torch.zeros(8192, 1, 576, dtype=torch.float16)
        with torch.inference_mode():
            for n in (int(x) for x in a.chunks.split(",")):
                h = torch.randn(n, c.hidden_size)
                meta = _meta(0, n, rot)
                cos, sin = rot(torch.arange(n))
                absorbed = _best(partial(mla, h, cache, meta))
                expanded = _best(partial(expanded_attention, mla, h, cos, sin))
                runs.append({"shape": name, "chunk": n, "absorbed_ms": absorbed * 1e3,
                             "expanded_ms": expanded * 1e3})
                rows.append([name, f"prefill chunk {n}", fmt(absorbed * 1e3),
                             fmt(expanded * 1e3), fmt(absorbed / expanded) + "x"])
            for ctx in (int(x) for x in a.contexts.split(",")):
                h = torch.randn(ctx, c.hidden_size)
                mla(h[:ctx - 1], cache, _meta(0, ctx - 1, rot))
                meta = _meta(ctx - 1, 1, rot)
                decode = _best(partial(mla, h[ctx - 1:], cache, meta), 5)
                runs.append({"shape": name, "context": ctx, "decode_ms": decode * 1e3})
                rows.append([name, f"decode at {ctx}", fmt(decode * 1e3), "", ""])
    print(markdown_table(["shape", "step", "absorbed ms", "expanded ms", "absorbed / expanded"],
                         rows))
    print(f"\n{torch.get_num_threads()} threads; load average {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    write_json(a.json, {"runs": runs, "load": load})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
