"""AIPerf (NVIDIA's load tester) as a subprocess: where it is installed, its command line and
ours for one workload, an environment in which it cannot download anything, and the headline
figures of its JSON report beside ours.

`python -m tests.loadtest.peer_aiperf AIPERF_DIR OURS.json` prints the two side by side as a
markdown table (docs/loadtest.md, "Third-party load testers").
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEER_VENV = REPO / ".venv-peers"
REQUIREMENTS = Path(__file__).with_name("peer_requirements.txt")
INSTALL_HINT = (
    "AIPerf is not installed (make peers installs it). It lives in its own virtual "
    "environment, since its pins "
    "(textual~=5.3) would downgrade ours: "
    f"python3 -m venv {PEER_VENV.name} && {PEER_VENV.name}/bin/pip install -r "
    f"{REQUIREMENTS.relative_to(REPO)}   (about 1.5 minutes, 1.2 GB), "
    "or point INFERSTACK_AIPERF at an `aiperf` executable.")
REPORT = "profile_export_aiperf.json"
RECORDS = "profile_export.jsonl"


def find_aiperf() -> str | None:
    """$INFERSTACK_AIPERF, else .venv-peers/bin/aiperf, else `aiperf` on the PATH."""
    candidates = [os.environ.get("INFERSTACK_AIPERF"), str(PEER_VENV / "bin" / "aiperf"),
                  shutil.which("aiperf")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@dataclass(frozen=True)
class Workload:
    """One closed-loop streaming chat workload that both tools can express."""
    requests: int = 20
    concurrency: int = 4
    prompt_tokens: int = 62  # the whole prompt after the chat template, as the server counts
    output_tokens: int = 16
    seed: int = 1


def aiperf_command(exe: str, url: str, model: str, tokenizer_dir: str, w: Workload,
                   out_dir: str) -> list[str]:
    # --apply-chat-template: AIPerf shortens its synthetic user text so that the templated
    # prompt has exactly prompt_tokens tokens by the exported tokenizer; the gateway's own
    # count then equals it only if the exported tokenizer and template are ours
    return [exe, "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", tokenizer_dir, "--apply-chat-template",
            "--synthetic-input-tokens-mean", str(w.prompt_tokens),
            "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(w.output_tokens), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true",
            "--concurrency", str(w.concurrency), "--request-count", str(w.requests),
            "--random-seed", str(w.seed), "--ui", "none", "--artifact-dir", out_dir,
            # nothing else to reach: no DCGM exporter, and /metrics is read by the test
            "--no-server-metrics", "--no-gpu-telemetry"]


def ours_command(url: str, w: Workload, template_tokens: int, out: str) -> list[str]:
    """Our load tester on the same workload: its random workload's user text is words of
    about one token each, so prompt_tokens less the template's own tokens."""
    return [sys.executable, "-m", "loadtest", "--url", url, "--workload", "random",
            "--endpoint", "chat", "--input-len", str(w.prompt_tokens - template_tokens),
            "--output-len", str(w.output_tokens), "--extra-body", '{"ignore_eos": true}',
            "--concurrency", str(w.concurrency), "--requests", str(w.requests),
            "--seed", str(w.seed), "--out", out, "--no-progress"]


def no_download_env(hf_home: str) -> dict[str, str]:
    """The environment for AIPerf: an empty Hugging Face home and a Hub at a closed port.

    Not HF_HUB_OFFLINE=1: in that mode AIPerf 0.13.0 resolves --tokenizer through
    `snapshot_download(local_files_only=True)`, which rejects a local folder. A Hub that
    refuses connections is as strict: any download attempt fails the run.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    return {**env, "HF_HOME": hf_home, "HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_DISABLE_TELEMETRY": "1", "NO_COLOR": "1"}


def read_report(out_dir: str) -> tuple[dict, list[dict]]:
    """AIPerf's summary report and its per-request records."""
    with open(os.path.join(out_dir, REPORT), encoding="utf-8") as f:
        report = json.load(f)
    with open(os.path.join(out_dir, RECORDS), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return report, records


# name, label; AIPerf's "inter_token_latency" is (latency - TTFT) / (tokens - 1) per request,
# which is our TPOT; its "inter_chunk_latency" is the gap between stream messages, our ITL
HEADLINE = [
    ("requests", "requests completed"), ("errors", "errors"),
    ("prompt_tokens", "prompt tokens (server usage)"),
    ("output_tokens", "output tokens"),
    ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
    ("tpot_mean_ms", "TPOT mean ms (AIPerf: ITL)"),
    ("itl_p50_ms", "ITL p50 ms (AIPerf: inter-chunk)"),
    ("e2e_p50_ms", "e2e p50 ms (AIPerf: request latency)"),
    ("output_tokens_per_s", "output tokens/s"), ("requests_per_s", "requests/s"),
    ("duration_s", "duration s"),
]


def aiperf_figures(report: dict) -> dict[str, float]:
    def m(name: str, stat: str = "avg") -> float:
        return report[name][stat]

    return {"requests": m("request_count"),
            "errors": sum(e.get("count", 1) for e in report.get("error_summary") or []),
            "prompt_tokens": m("total_usage_prompt_tokens"), "output_tokens": m("total_osl"),
            "ttft_p50_ms": m("time_to_first_token", "p50"),
            "ttft_p99_ms": m("time_to_first_token", "p99"),
            "tpot_mean_ms": m("inter_token_latency"),
            "itl_p50_ms": m("inter_chunk_latency", "p50"),
            "e2e_p50_ms": m("request_latency", "p50"),
            "output_tokens_per_s": m("output_token_throughput"),
            "requests_per_s": m("request_throughput"), "duration_s": m("benchmark_duration")}


def ours_figures(result: dict) -> dict[str, float]:
    s = result["summary"]
    lat, tok, thr = s["latency_ms"], s["tokens"], s["throughput"]
    return {"requests": s["requests"]["completed"], "errors": s["requests"]["failed"],
            "prompt_tokens": tok["prompt"], "output_tokens": tok["completion_reported"],
            "ttft_p50_ms": lat["ttft"]["p50"], "ttft_p99_ms": lat["ttft"]["p99"],
            "tpot_mean_ms": lat["tpot"]["mean"], "itl_p50_ms": lat["itl"]["p50"],
            "e2e_p50_ms": lat["e2e"]["p50"],
            "output_tokens_per_s": thr["output_tokens_per_s"],
            "requests_per_s": thr["requests_per_s"], "duration_s": s["duration_s"]}


def side_by_side(theirs: dict[str, float], ours: dict[str, float]) -> str:
    lines = ["| figure | AIPerf | ours | AIPerf / ours |", "|---|---:|---:|---:|"]
    for key, label in HEADLINE:
        a, b = theirs[key], ours[key]
        ratio = f"{a / b:.3f}" if b else "-"
        lines.append(f"| {label} | {a:,.1f} | {b:,.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.loadtest.peer_aiperf AIPERF_ARTIFACT_DIR OURS.json",
              file=sys.stderr)
        return 2
    report, _ = read_report(argv[0])
    with open(argv[1], encoding="utf-8") as f:
        result = json.load(f)
    print(side_by_side(aiperf_figures(report), ours_figures(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
