"""The contract between the gateway and the runtime, and the only part of the runtime's world
the gateway imports: typed frames and their codec, sampling parameters, errors, engine settings,
model-file facts, the tokenizer and chat template both sides must agree on, and block hashing.
Nothing here imports torch, `runtime` or `gateway` (tests/test_import_rules.py)."""
