"""`python -m runtime.ep_sim`: simulate DeepSeek-V3's published expert-parallel deployments
(prefill EP32, decode EP144, 32 redundant experts, H800 nodes of 8) on a skewed routing trace,
without and with the expert-parallel load balancer, beside DeepSeek's published per-node
throughput. The model of a step is runtime/ep/sim.py's; every figure it assumes is a flag."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from runtime.ep import costs
from runtime.ep.sim import Deployment, SimResult, simulate
from runtime.ep.trace import zipf_for_hot_ratio

# DeepSeek's day-6 overview (2025-03-01): per H800 node, averaged over 24 hours of service
PUBLISHED = {"prefill": 73_700.0, "decode": 14_800.0}
NOTES = (
    "published: 24-hour averages of a live service (nodes scaled down off-peak, batches not "
    "always full), not a saturated step as simulated here",
    "prefill 'incl. hits' counts input tokens served by the prefix cache (--cache-hit, "
    "56.3% published) as DeepSeek's figure does; they cost no compute here",
    "decode counts MTP's accepted draft tokens (--mtp-accept); MTP's own layer is not costed",
    "efficiencies (--gemm-efficiency, --memory-efficiency) are assumptions, not measurements; "
    "kernel launch, softmax/norm/rope, routing and the micro-batch split are not modelled",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.ep_sim", description=__doc__)
    p.add_argument("--phase", choices=["prefill", "decode", "both"], default="both")
    p.add_argument("--prefill-gpus", type=int, default=32)
    p.add_argument("--decode-gpus", type=int, default=144)
    p.add_argument("--redundant", type=int, default=32, help="redundant expert slots")
    p.add_argument("--prefill-tokens-per-gpu", type=int, default=16384)
    p.add_argument("--decode-requests-per-gpu", type=int, default=128)
    p.add_argument("--prefill-context", type=float, default=2048.0,
                   help="average context a prefill token attends to (4K prompts: 2K)")
    p.add_argument("--decode-context", type=float, default=4989.0,
                   help="average KV length per decoded token (DeepSeek's published 4,989)")
    p.add_argument("--mtp-accept", type=float, default=0.85)
    p.add_argument("--cache-hit", type=float, default=0.563)
    p.add_argument("--hot-ratio", type=float, default=8.0,
                   help="skew of the synthetic trace: hottest expert's tokens / mean")
    p.add_argument("--zipf-s", type=float, default=None,
                   help="the trace's Zipf exponent directly (instead of --hot-ratio)")
    p.add_argument("--no-overlap", action="store_true",
                   help="all-to-all adds to compute instead of hiding behind it")
    p.add_argument("--sample-per-gpu", type=int, default=512)
    p.add_argument("--history-per-gpu", type=int, default=512)
    p.add_argument("--layers-simulated", type=int, default=0, help="MoE layers routed (0: all)")
    hw = costs.Hardware()
    for name in ("fp8_tflops", "bf16_tflops", "hbm_gbs", "nvlink_gbs", "ib_gbs",
                 "gemm_efficiency", "memory_efficiency"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(hw, name))
    p.add_argument("--gpus-per-node", type=int, default=hw.gpus_per_node)
    p.add_argument("--expert-us-per-token", type=float, default=None,
                   help="one (token, expert) assignment in one layer, replacing the roofline")
    p.add_argument("--attn-us-per-token", type=float, default=None,
                   help="one token's attention in one layer, replacing the roofline")
    p.add_argument("--measure-cpu", action="store_true",
                   help="time a real MoE block on this CPU and use it as the expert cost")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model = costs.ModelShape()
    hw = costs.Hardware(a.fp8_tflops, a.bf16_tflops, a.hbm_gbs, a.nvlink_gbs, a.ib_gbs,
                        a.gpus_per_node, a.gemm_efficiency, a.memory_efficiency)
    expert_s = None if a.expert_us_per_token is None else a.expert_us_per_token * 1e-6
    if a.measure_cpu:
        m = costs.measure_cpu_expert_seconds()
        expert_s = m["v3_seconds_per_assignment"]
        print(f"this CPU: a real MoE block at hidden 1792 x 512 ran {m['flops_per_s'] / 1e9:.1f} "
              f"GFLOP/s: {expert_s * 1e6:.1f} us per assignment at V3's widths")
    zipf_s = a.zipf_s if a.zipf_s is not None else zipf_for_hot_ratio(
        a.hot_ratio, model.experts, model.k, model.groups, model.groups_kept, seed=a.seed)
    common = dict(redundant=a.redundant, overlap=not a.no_overlap,
                  sample_per_gpu=a.sample_per_gpu, history_per_gpu=a.history_per_gpu,
                  layers_simulated=a.layers_simulated, expert_s_per_token=expert_s,
                  attn_s_per_token=None if a.attn_us_per_token is None
                  else a.attn_us_per_token * 1e-6)
    deps = []
    if a.phase in ("prefill", "both"):
        deps.append(Deployment("prefill", a.prefill_gpus, tokens_per_gpu=a.prefill_tokens_per_gpu,
                               context=a.prefill_context, cache_hit=a.cache_hit, **common))
    if a.phase in ("decode", "both"):
        deps.append(Deployment("decode", a.decode_gpus, tokens_per_gpu=a.decode_requests_per_gpu,
                               context=a.decode_context, mtp_accept=a.mtp_accept, **common))
    results = [simulate(d, model, hw, zipf_s, a.seed) for d in deps]
    print(render(results, hw, zipf_s))
    return 0


def render(results: list[SimResult], hw: costs.Hardware, zipf_s: float) -> str:
    lines = [f"DeepSeek-V3 on H800 nodes of {hw.gpus_per_node}; routing trace Zipf s={zipf_s:.3f}",
             "", "| phase | GPUs | redundant | trace hot/mean | policy | imbalance static -> EPLB "
             "| step ms static -> EPLB | tok/s/GPU static -> EPLB | tok/s/node EPLB "
             "| incl. cache hits | published/node |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = r.deployment
        per_gpu = [o.tokens_per_s_gpu(d) for o in (r.static, r.eplb)]
        node = per_gpu[1] * hw.gpus_per_node
        hits = node / (1.0 - d.cache_hit) if d.phase == "prefill" else node
        lines.append(
            f"| {d.phase} | {d.gpus} | {d.redundant} | {r.hot_ratio:.2f} | {r.policy} "
            f"| {r.static.imbalance:.2f} -> {r.eplb.imbalance:.2f} "
            f"| {r.static.step_s * 1e3:.1f} -> {r.eplb.step_s * 1e3:.1f} "
            f"| {per_gpu[0]:,.0f} -> {per_gpu[1]:,.0f} | {node:,.0f} | {hits:,.0f} "
            f"| {PUBLISHED[d.phase]:,.0f} ({hits / PUBLISHED[d.phase]:.2f}x) |")
    for r in results:
        lines += ["", f"{r.deployment.phase}: step parts on the slowest GPU, ms "
                  "(static -> EPLB; all-to-all hidden behind compute with overlap)"]
        for key in r.eplb.parts_s:
            lines.append(f"  {key:>16}: {r.static.parts_s[key] * 1e3:8.2f} -> "
                         f"{r.eplb.parts_s[key] * 1e3:8.2f}")
        for name, o in (("static", r.static), ("EPLB", r.eplb)):
            lines.append(f"{r.deployment.phase} per-GPU received tokens a layer / mean, {name}:")
            lines += _rows(o.per_gpu / o.per_gpu.mean())
    lines += ["", "notes:"] + [f"- {n}" for n in NOTES]
    return "\n".join(lines)


def _rows(values: np.ndarray, width: int = 16) -> list[str]:
    return ["  " + " ".join(f"{v:4.2f}" for v in values[i:i + width])
            for i in range(0, len(values), width)]


if __name__ == "__main__":
    sys.exit(main())
