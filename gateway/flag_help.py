"""The `--help` text of each of the gateway's own settings (gateway/config.py builds the flags
from `GatewayConfig`'s fields; the engine settings carry theirs in contract/engine_settings.py).
tests/test_readme_flags.py and tests/gateway/test_cli_flags.py hold the README and the help
to the same flags."""
from __future__ import annotations

import argparse

HELP = {
    "host": "address to listen on; beyond loopback it needs --keys-file or --api-key (or "
            "--allow-insecure-no-auth)",
    "port": "TCP port",
    "model": "a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)",
    "workers": "runtime worker processes (one per GPU; on CPU, each with a thread budget); "
               "0 with --worker-url: only shared workers",
    "worker_urls": "a shared worker (`python -m runtime serve`) to use as well, "
                   "tcp://HOST:PORT; repeat the flag for several (environment: "
                   "comma-separated; TOML: a list); the secret is INFERSTACK_WORKER_TOKEN",
    "gateways": "gateway processes on this host sharing --port (SO_REUSEPORT), with the "
                "--workers started once as shared workers; needs --state-url and --redis-url",
    "reuse_port": argparse.SUPPRESS,
    "autoscale_min": "autoscale: the fewest workers (with --autoscale-max)",
    "autoscale_max": "autoscale: the most workers; 0 turns autoscaling off",
    "autoscale_queue_depth": "autoscale: queue depth above which the pool grows",
    "autoscale_grow_seconds": "autoscale: seconds the queue must stay deep before a worker "
                              "is added",
    "autoscale_idle_seconds": "autoscale: seconds a worker must idle before it is drained",
    "autoscale_cooldown_seconds": "autoscale: seconds between two changes",
    "worker_drain_seconds": "seconds a removed worker's requests may run before they are "
                            "aborted (and billed for what they produced)",
    "fleet_ttl_seconds": "seconds a gateway stays in the fleet view (Redis) after its last "
                         "heartbeat",
    "threads_per_worker": "torch threads per CPU worker (0: cores divided by workers)",
    "max_queue": "requests that may wait in the gateway before 429",
    "aging_seconds": "seconds of waiting that raise a request by one priority class",
    "tenant_max_running_share": "share of the fleet's running slots (max-num-seqs x workers) "
                                "one tenant may hold while another tenant's request waits; a "
                                "tenant over it is preempted for a waiting tenant under its "
                                "own, and one alone may use them all (a key file's "
                                "max_running_share overrides it per tenant)",
    "affinity_margin": "load margin within which the prefix's worker is preferred",
    "max_body_bytes": "largest request body accepted (413 above)",
    "default_max_tokens": "output budget when a request gives none (default: rest of context)",
    "keepalive_seconds": "SSE keep-alive comment interval on a quiet stream",
    "body_timeout_seconds": "seconds a client may take to send its request body (408 after)",
    "header_timeout_seconds": "seconds a client may take to send a request's line and headers "
                              "(408 after; 0: no limit)",
    "idle_timeout_seconds": "seconds an HTTP connection may stay open with no request in flight",
    "send_timeout_seconds": "seconds a client may leave a stream unread (a write waiting on it, "
                            "or a WebSocket ping unanswered) before its requests are aborted and "
                            "billed for what they produced (0: no limit)",
    "stream_buffer_bytes": "unread output one request may hold in the gateway before it is "
                           "aborted (the client reads too slowly)",
    "drain_timeout_seconds": "on SIGTERM, seconds in-flight requests may take to finish "
                             "(a second SIGTERM aborts at once)",
    "worker_ready_timeout": "seconds a worker may take to load its model",
    "keys_file": "TOML file of API keys and tenants (without it: loopback only, one tenant, "
                 "every caller is admin)",
    "api_key": "one admin key every request must send (Authorization: Bearer KEY), for the "
               "tenant 'default'; as vLLM's --api-key; prefer INFERSTACK_API_KEY, which ps does "
               "not show; not with --keys-file (put an admin key there instead)",
    "allow_insecure_no_auth": "allow serving without --keys-file on a non-loopback address: "
                              "anyone who reaches it is admin and unmetered",
    "prices": "price preset (seed, deepseek-v3, deepseek-r1) or a price-book TOML file",
    "ledger_path": "SQLite ledger of finished requests (default: in the cache folder); with "
                   "--state-url, settlements waiting for PostgreSQL are kept beside it",
    "state_url": "PostgreSQL URL (postgresql://user:password@host:port/db) holding the ledger "
                 "and the budgets, shared by every gateway given it; unreachable, budgets fail "
                 "closed with 503 (default: the SQLite ledger and budgets in this process)",
    "redis_url": "Redis URL (redis://host:port/db) holding the per-tenant rate limits and the "
                 "fair-share clock, shared by every gateway given it; unreachable, requests "
                 "are refused with 503 (default: in this process)",
    "fair_share_tokens_per_second": "nominal rate converting tokens to fair-share time",
    "telemetry": "record request spans and serve the live feed (/admin/telemetry)",
    "otlp_endpoint": "OTLP/HTTP collector base URL, e.g. http://127.0.0.1:4318",
    "otlp_interval_seconds": "seconds between OTLP metric pushes",
    "fake": "serve a deterministic fake engine instead of a model",
    "fake_step_ms": "simulated milliseconds per fake engine step",
    "pd": "prefill/decode disaggregation: P:D starts P prefill and D decode workers that "
          "move prompt KV over torch.distributed (instead of --workers)",
    "kv_store_port": "loopback port of the TCPStore for KV-transfer groups (0: any free)",
    "served_model_name": "the model names clients may ask for, separated by spaces: the "
                         "first is the one reported; any other is 404 (default: the model "
                         "file's name)",
    "sampling_defaults": "sampling for fields a request omits: 'model' (generation_config.json "
                         "of a HF folder, else the GGUF profile), 'none' (OpenAI's: "
                         "temperature 1), a profile name (llama-cpp) or KEY=VALUE,... over "
                         "'model' (temperature, top_p, top_k, min_p, repetition_penalty)",
    "reasoning_parser": "split a reasoning model's think block from its answer "
                        "(message.reasoning_content): auto (from the chat template: one that "
                        "mentions <think> gets deepseek-r1 or qwen3, others none), deepseek-r1, "
                        "qwen3 or none",
    "tool_call_parser": "the tool-call syntax read from answers under tool_choice auto: auto "
                        "(the family whose markers the chat template names, else hermes), "
                        "hermes (<tool_call> blocks: Hermes, Qwen 2.5/3), llama3_json "
                        "(Llama 3.1-3.3), mistral, deepseek_v3 (V3, R1, V3.1) or gemma3 "
                        "(Python calls); every one also reads <tool_call> blocks",
    "responses_store_seconds": "seconds a /v1/responses answer is kept per tenant for "
                               "previous_response_id (0: not stored; such requests get 400)",
    "responses_store_max": "responses kept per tenant (the oldest is dropped first)",
    "access_log": "log one line per HTTP request (method, path, status, tenant, tokens, TTFT, "
                  "duration) to stderr",
    "log_format": "the access log's and the summary's lines: text or json (one object a line)",
    "log_summary_seconds": "log a summary (requests/s, output tokens/s, queue, KV use, "
                           "cache-hit rate) this often while there is traffic (0: off)",
    "ray_address": "run workers as Ray actors on this Ray cluster (an address or auto); "
                   "needs the ray extra",
    "debug": "show the traceback of a start-up error (the gateway's and each worker's), not "
             "only its one line",
    # the Batch API (gateway/batch/)
    "batch_api": "serve OpenAI's Files and Batch API (/v1/files, /v1/batches), running batch "
                 "lines only in idle capacity",
    "batch_max_file_bytes": "largest file /v1/files takes, in bytes (413 over it)",
    "batch_max_lines": "most lines one batch input file may hold (400 over it)",
    "batch_max_open": "most batches a tenant may have open (validating, in progress, "
                      "finalizing or cancelling) at once (429 over it)",
    "batch_idle_margin": "fraction of the workers' request slots (at least one) and KV blocks "
                         "batch lines leave free for online requests",
    "batch_max_queued": "most batch lines admitted and not yet on a worker at once",
    "batch_lease_seconds": "a gateway's hold on a batch it runs; another gateway takes the "
                           "batch over this long after the holder stopped renewing it",
}
