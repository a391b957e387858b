"""How far each `--quantization` moves the shipped model from the file's own float weights.

For int8 and int4, through the quantized kernel (every step) and through its float copy (the
large-step path): the largest logit error over the prompt positions relative to the largest
logit (the file's float32 dequantization as reference), and where greedy decoding first
differs from the reference in 32 tokens. Accuracy, not speed: the machine's load does not
change these figures.

    python -m bench.quant_accuracy
"""
from __future__ import annotations

import argparse
import sys

from bench.common import log, markdown_table, write_json

PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):\n    ",
           "Water boils at a temperature of", "List three colours of the rainbow:"]
TOKENS = 32


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__,  # no settings: --help says what it measures
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    from contract.config import EngineConfig
    from contract.sampling_params import SamplingParams
    from runtime.engine import LLMEngine
    from runtime.loading.loader import default_model_path, load_checkpoint

    ck = load_checkpoint(default_model_path())
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)

    def engine(**kw):
        return LLMEngine(ck, EngineConfig(kv_cache_bytes=64 << 20, **kw))

    ref = engine(quantization="none")
    ids = [ref.tokenizer.encode(p) for p in PROMPTS]
    ref_logits = [ref.prompt_logits(p) for p in ids]
    ref_tokens = ref.generate(ids, params)
    rows, results = [], []
    for kind in ("int8", "int4"):
        for path, rows_limit in (("kernel", 10_000), ("float copy", 0)):
            log(f"[quant] {kind} {path}")
            e = engine(quantization=kind, quant_max_rows=rows_limit)
            errors = [float((e.prompt_logits(p) - r).abs().max() / r.abs().max())
                      for p, r in zip(ids, ref_logits)]
            out = e.generate(ids, params)
            first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), TOKENS)
                     for x, y in zip(out, ref_tokens)]
            results.append({"quantization": kind, "path": path, "logit_errors": errors,
                            "first_differing_token": first})
            rows.append([kind, path, " / ".join(f"{x:.3f}" for x in errors),
                         " / ".join(str(f) for f in first)])
    table = markdown_table(["quantization", "path", "logit error vs file, per prompt",
                            f"first differing greedy token (of {TOKENS})"], rows)
    print(table)
    write_json("bench/results/quant_accuracy.json", {"benchmark": "quant_accuracy",
                                                     "prompts": PROMPTS, "results": results,
                                                     "table_markdown": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
