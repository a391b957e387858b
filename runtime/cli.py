"""`python -m runtime generate|info|export-tokenizer`: the runtime alone, without the gateway
(`python -m runtime serve` is runtime/transport/serve.py, handed over by runtime/__main__.py)."""
from __future__ import annotations

import argparse
import sys
import time

from contract.engine_settings import add_worker_flags, settings_from_args
from contract.errors import RuntimeErrorBase
from contract.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runtime",
        description="Run the inference runtime from the shell. `python -m runtime serve --port "
                    "P` runs one engine shared by many gateways (`serve --help`).")
    parser.add_argument("--model", default=None,
                        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M)")
    add_worker_flags(parser)  # the engine settings, declared once (contract/engine_settings.py)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion to stdout")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message with the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    sub.add_parser("info", help="print the model's shape and KV capacity")
    export = sub.add_parser("export-tokenizer",
                            help="write the model's tokenizer as a Hugging Face folder (for "
                                 "load testers that count tokens, such as AIPerf)")
    export.add_argument("dir", help="the folder to write (created when missing)")
    # SUPPRESS: given here it wins; absent, the --model before the command still counts
    export.add_argument("--model", default=argparse.SUPPRESS,
                        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M)")
    return parser


def make_engine(args):
    """The engine, its start-up stages printed on stderr as the worker logs them."""
    from runtime.engine import LLMEngine
    from runtime.loading import progress

    progress.show_on_stderr()
    engine = LLMEngine.from_model_path(args.model, settings_from_args(args).engine_config())
    progress.log_ready()
    return engine


def cmd_generate(args) -> int:
    engine = make_engine(args)
    tok = engine.tokenizer
    text = (tok.apply_chat_template([{"role": "user", "content": args.prompt}])
            if args.chat else args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop))
    engine.add_request("cli", tok.encode(text), params)
    start, first, n = time.perf_counter(), None, 0
    usage = reason = None
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            first = first or time.perf_counter()
            n += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            usage, reason = out.usage, out.finish_reason
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    decode_rate = (n - 1) / (elapsed - (first - start)) if n > 1 else 0.0
    c = engine.counters
    spec = (f"; speculation accepted {c.spec_accepted_tokens}/{c.spec_draft_tokens} proposed"
            if c.spec_draft_tokens else "")
    print(f"[{usage.prompt_tokens} prompt, {usage.completion_tokens} completion tokens; "
          f"finish {reason}; first token {first - start:.3f}s; decode {decode_rate:.1f} tok/s"
          f"{spec}]", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    engine = make_engine(args)
    c, r = engine.model_config, engine.runner
    rows = [
        ("model", c.name), ("source", engine.checkpoint.source),
        ("architecture", c.architecture), ("layers", c.num_hidden_layers),
        ("hidden size", c.hidden_size), ("intermediate size", c.intermediate_size),
        ("attention heads", c.num_attention_heads), ("kv heads", c.num_key_value_heads),
        ("head dim", c.head_dim), ("vocab size", c.vocab_size),
        ("context length", engine.max_model_len), ("rope theta", c.rope_theta),
        ("tied embeddings", c.tie_word_embeddings), ("device", str(r.device)),
        ("dtype", str(r.dtype).removeprefix("torch.")),
        ("kv block size", engine.config.block_size), ("kv blocks", r.num_blocks),
        ("kv capacity (tokens)", engine.kv_capacity_tokens),
        ("load seconds", f"{engine.checkpoint.load_seconds:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_export_tokenizer(args) -> int:
    from runtime.loading.tokenizer_export import export_tokenizer

    try:
        files = export_tokenizer(args.dir, args.model)
    except OSError as exc:  # an unwritable folder is the user's to fix, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in files:
        print(path)
    print(f"[load it offline with transformers.AutoTokenizer.from_pretrained({args.dir!r})]",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"generate": cmd_generate, "info": cmd_info,
                    "export-tokenizer": cmd_export_tokenizer}
        return commands[args.command](args)
    except RuntimeErrorBase as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
