"""How often each sampling profile answers the README's question right on the shipped model.

    python -m bench.sampling_profiles [--seeds 40] [--max-tokens 32]

Not a speed benchmark: the measurement behind the greedy default for GGUF files that name no
sampling of their own (contract/sampling_defaults.py, README "Model names and sampling
defaults"). Each profile answers "What is the capital of France?" once per seed, all seeds of
a profile batched together; an answer is right when it names Paris.
"""
from __future__ import annotations

import argparse

from bench.common import REPO_ROOT, log, markdown_table, setup_threads, write_json
from contract.config import EngineConfig
from contract.sampling_defaults import PROFILES
from contract.sampling_params import SamplingParams
from runtime.engine import LLMEngine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def answers(engine: LLMEngine, profile: dict, seeds: int, max_tokens: int) -> list[str]:
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(QUESTION))
    for s in range(seeds):
        params = SamplingParams(max_tokens=max_tokens, seed=1000 + s,
                                **{"temperature": 1.0, **profile})
        engine.add_request(f"r{s}", prompt, params)
    texts = [""] * seeds
    while engine.has_unfinished_requests():
        outputs, _ = engine.step()
        for o in outputs:
            texts[int(o.request_id[1:])] += o.new_text
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    setup_threads()
    engine = LLMEngine.from_model_path(None, EngineConfig())
    rows, result = [], {}
    for name, profile in PROFILES.items():
        texts = answers(engine, profile, args.seeds, args.max_tokens)
        right = sum("Paris" in t for t in texts)
        wrong = next((t for t in texts if "Paris" not in t), "")
        rows.append([name, f"{right}/{args.seeds}", wrong[:60].replace("\n", " ")])
        result[name] = {"right": right, "seeds": args.seeds, "texts": texts}
        log(f"{name}: {right}/{args.seeds}")
    print(markdown_table(["profile", "names Paris", "a wrong answer"], rows))
    write_json(REPO_ROOT / "bench" / "results" / "sampling_profiles.json", result)


if __name__ == "__main__":
    main()
