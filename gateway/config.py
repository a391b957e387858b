"""Gateway settings: defaults < TOML file < environment (INFERSTACK_*) < command-line flags."""
from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import socket
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from contract.engine_settings import EngineSettings, with_default
from contract.errors import ModelLoadError
from contract.frames import is_loopback
from contract.model_files import FAKE_MODEL_NAME, default_model_path, model_name
from contract.sampling_defaults import SamplingSpec, parse_spec
from gateway.flag_help import HELP
from gateway.openai.reasoning import PARSERS as REASONING_PARSERS
from gateway.openai.tool_parsers import TOOL_CALL_PARSERS

LOG_FORMATS = ("text", "json")  # the access log's and the summary's line formats
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineSettings))


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's own settings, and the engine settings it gives every worker (`engine`:
    device, kv_cache_gb, max_num_seqs, ..., declared once in contract/engine_settings.py).
    Both are flat to an operator: one flag, variable or TOML key per setting."""

    engine: EngineSettings = field(default_factory=EngineSettings)
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None  # a .gguf file or HF folder; None: SmolLM2-135M-Instruct
    workers: int = 1  # worker processes this gateway starts; 0: only --worker-url ones
    worker_urls: tuple[str, ...] = ()  # tcp://HOST:PORT of shared workers (runtime.transport.serve)
    gateways: int = 1  # > 1: a supervisor of that many gateway processes on one port
    reuse_port: bool = False  # internal: a fleet child binds the shared port (SO_REUSEPORT)
    autoscale_min: int = 1  # autoscale: never fewer workers than this
    autoscale_max: int = 0  # autoscale: 0 off; else spawn up to this many under a held queue
    autoscale_queue_depth: int = 0  # a queue deeper than this counts as pressure
    autoscale_grow_seconds: float = 10.0  # the queue stays deep this long before growing
    autoscale_idle_seconds: float = 60.0  # a worker idle this long (queue empty) is drained
    autoscale_cooldown_seconds: float = 10.0  # after each change, before the next decision
    worker_drain_seconds: float = 300.0  # DELETE /admin/workers: then running ones are aborted
    fleet_ttl_seconds: float = 5.0  # a gateway's fleet entry in Redis outlives its last beat
    threads_per_worker: int = 0  # torch threads per CPU worker; 0: cores / workers
    max_queue: int = 1024  # requests waiting in the gateway before 429
    aging_seconds: float = 30.0  # waiting this long improves a request by one priority class
    tenant_max_running_share: float = 0.5  # of the fleet's slots a tenant holds while others wait
    affinity_margin: float = 0.25  # prefer the prefix's worker unless busier by this load
    max_body_bytes: int = 4 << 20
    default_max_tokens: int | None = None  # None: the rest of the context
    keepalive_seconds: float = 10.0  # SSE comment while a stream is quiet
    body_timeout_seconds: float = 30.0  # a client must send its whole body within this (408)
    header_timeout_seconds: float = 20.0  # ... and each request head (line + headers) (408)
    idle_timeout_seconds: float = 75.0  # a connection with no request in flight closes after this
    send_timeout_seconds: float = 30.0  # a client that reads nothing this long is cut off
    stream_buffer_bytes: int = 4 << 20  # unread output one request may hold before it is cut
    drain_timeout_seconds: float = 30.0  # on SIGTERM: in-flight requests may finish within this
    worker_ready_timeout: float = 600.0
    keys_file: str | None = None  # API keys and tenants (TOML); None: loopback, one tenant
    api_key: str | None = field(default=None, repr=False)  # one admin key (vLLM's --api-key)
    allow_insecure_no_auth: bool = False  # serve without keys on a non-loopback address
    prices: str = "seed"  # a preset (seed, deepseek-v3, deepseek-r1) or a price-book TOML
    ledger_path: str | None = None  # SQLite ledger; None: <cache dir>/ledger.sqlite3
    state_url: str | None = None  # postgresql://...: ledger and budgets shared by gateways
    redis_url: str | None = None  # redis://...: rate limits and fair share shared by gateways
    fair_share_tokens_per_second: float = 1000.0
    telemetry: bool = True  # request spans and the live feed
    otlp_endpoint: str | None = None  # OTLP/HTTP collector base URL (traces and metrics)
    otlp_interval_seconds: float = 10.0
    fake: bool = False  # deterministic fake engine instead of a model (tests, benchmarks)
    fake_step_ms: float = 2.0
    pd: str | None = None  # "P:D": P prefill and D decode workers (replaces --workers)
    kv_store_port: int = 0  # the gateway's TCPStore for KV-transfer groups; 0: any free port
    ray_address: str | None = None  # place workers as Ray actors on this cluster ("auto")
    served_model_name: str | None = None  # "NAME [ALIAS ...]": the names clients may ask for
    sampling_defaults: str | None = None  # "model", "none", a profile name or KEY=VALUE,...
    reasoning_parser: str = "auto"  # think blocks apart: auto (the template's), deepseek-r1, ...
    tool_call_parser: str = "auto"  # the calls "auto" reads: auto (the template's), hermes, ...
    responses_store_seconds: float = 3600.0  # /v1/responses kept for previous_response_id
    responses_store_max: int = 1000  # stored responses per tenant (oldest dropped first)
    access_log: bool = True  # one line per HTTP request on the logger "gateway.access"
    log_format: str = "text"  # text | json: the access log's and the summary's lines
    log_summary_seconds: float = 10.0  # a throughput summary this often, while busy; 0: off
    debug: bool = False  # a start error's traceback too, not only its one line
    # the Batch API (gateway/batch/): its limits, and how much room it leaves online requests
    batch_api: bool = True
    batch_max_file_bytes: int = 100 << 20
    batch_max_lines: int = 50_000
    batch_max_open: int = 16
    batch_idle_margin: float = 0.1
    batch_max_queued: int = 4
    batch_lease_seconds: float = 15.0

    def pd_split(self) -> tuple[int, int] | None:
        """(prefill, decode) worker counts when disaggregated, else None."""
        if not self.pd:
            return None
        try:
            p, d = (int(x) for x in self.pd.split(":"))
        except ValueError:
            raise SystemExit(f"--pd takes P:D (such as 1:1), not {self.pd!r}") from None
        if p < 1 or d < 1:
            raise SystemExit("--pd needs at least one prefill and one decode worker")
        if self.fake:
            raise SystemExit("--pd needs a model: the fake engine has no KV to move")
        return p, d

    def served_names(self) -> tuple[str, ...]:
        """The names clients may ask for, the reported one first: --served-model-name, else
        the model file's own name (contract/model_files.py, the rule the worker follows)."""
        if self.served_model_name:
            names = tuple(dict.fromkeys(self.served_model_name.replace(",", " ").split()))
            if names:
                return names
        if self.fake:
            return (FAKE_MODEL_NAME,)
        try:
            return (model_name(self.model or default_model_path()),)
        except ModelLoadError as exc:
            raise SystemExit(str(exc)) from None

    def sampling_spec(self) -> SamplingSpec:
        """--sampling-defaults parsed; a bad one stops the start with its reason."""
        try:
            return parse_spec(self.sampling_defaults)
        except ValueError as exc:
            raise SystemExit(f"--sampling-defaults: {exc}") from None

    def check_engine(self) -> None:
        """Engine settings EngineConfig refuses (an unknown --kv-cache-dtype, a zero token
        budget) stop the start with the reason, not each worker as it starts."""
        try:
            self.engine.engine_config()
        except ValueError as exc:
            raise SystemExit(f"engine settings: {exc}") from None

    def check_fleet(self) -> None:
        """Worker and gateway counts that cannot work stop the start with the reason."""
        if not 0 < self.tenant_max_running_share <= 1:
            raise SystemExit("--tenant-max-running-share must be in (0, 1]")
        if self.workers < 0 or self.gateways < 1 or self.threads_per_worker < 0:
            raise SystemExit("--workers and --threads-per-worker must be 0 or more and "
                             "--gateways 1 or more")
        if self.workers == 0 and not self.worker_urls and not self.pd:
            raise SystemExit("--workers 0 needs at least one --worker-url tcp://HOST:PORT "
                             "(a shared `python -m runtime serve` worker) to send requests to")
        if self.pd and self.worker_urls:
            raise SystemExit("--pd and --worker-url do not mix: a shared worker does not move "
                             "KV between workers")
        if self.autoscale_max and (self.autoscale_max < self.autoscale_min or self.pd
                                   or self.ray_address):
            raise SystemExit("--autoscale-max must be at least --autoscale-min, and not with "
                             "--pd or --ray-address")
        if self.gateways > 1 and (self.pd or self.ray_address):
            raise SystemExit("--gateways N shares its workers over TCP: not with --pd or "
                             "--ray-address")
        if self.gateways > 1 and not (self.state_url and self.redis_url):
            raise SystemExit(
                "--gateways N needs both --state-url (PostgreSQL) and --redis-url (Redis): "
                "each gateway process would otherwise keep its own SQLite ledger and its own "
                "in-process rate limits, so every budget and limit would be enforced per "
                "gateway and a tenant could spend N times its budget")

    def check_port(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SystemExit(f"--port takes 0 to 65535, not {self.port}")

    def num_workers(self) -> int:
        split = self.pd_split()
        return sum(split) if split else self.workers

    def worker_argv(self) -> list[str]:
        argv = self.engine.worker_flags() + ["--threads", str(self.threads())]
        if self.model:
            argv += ["--model", self.model]
        if self.fake:
            argv += ["--fake", "--fake-step-ms", str(self.fake_step_ms)]
        if self.debug:
            argv.append("--debug")
        return argv

    def resolved_ledger_path(self) -> str:
        if self.ledger_path:
            return self.ledger_path
        base = os.environ.get("INFERSTACK_CACHE_DIR") or os.path.expanduser("~/.cache/inferstack")
        os.makedirs(base, mode=0o700, exist_ok=True)  # the ledger names tenants and money
        return os.path.join(base, "ledger.sqlite3")

    def is_loopback(self) -> bool:
        """Every address the gateway would listen on is a loopback one."""
        return is_loopback_host(self.host)

    def threads(self) -> int:
        if self.threads_per_worker:
            return self.threads_per_worker
        return max(1, (os.cpu_count() or 1) // max(1, self.num_workers()))


is_loopback_host = is_loopback  # the one check, shared with runtime/transport/serve.py


def check_batch(config: GatewayConfig) -> None:
    """The Batch API's limits: positive counts, a margin in [0, 1)."""
    for name in ("batch_max_file_bytes", "batch_max_lines", "batch_max_open",
                 "batch_max_queued", "batch_lease_seconds"):
        if getattr(config, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= config.batch_idle_margin < 1:
        raise SystemExit("--batch-idle-margin must be in [0, 1)")


def refuse_open_keyless(config: GatewayConfig) -> None:
    """Without keys (--keys-file or --api-key) every caller is admin and unmetered: that is for
    loopback only."""
    if config.api_key is not None and config.api_key != config.api_key.strip():
        raise SystemExit("--api-key (INFERSTACK_API_KEY) starts or ends with white space")
    if config.api_key and config.keys_file:
        raise SystemExit("--api-key and --keys-file do not mix: with a key file, give the admin "
                         "key there ([[keys]] with admin = true; python -m billing.keys hash KEY)")
    if config.keys_file or config.api_key or config.allow_insecure_no_auth or config.is_loopback():
        return
    raise SystemExit(
        f"refusing to listen on {config.host!r} without --keys-file or --api-key: with no keys, "
        f"anyone who can reach the gateway is its administrator (usage, telemetry, unmetered "
        f"generation). Give --keys-file or --api-key (INFERSTACK_API_KEY), listen on "
        f"127.0.0.1, or pass --allow-insecure-no-auth if this network is yours alone.")


_LISTEN_REASONS = {
    errno.EADDRINUSE: "address already in use (another server? choose --port)",
    errno.EACCES: "permission denied (a port below 1024 needs privileges; choose --port)",
    errno.EADDRNOTAVAIL: "not an address of this machine (choose --host)",
}


def listen_problem(host: str, port: int, exc: OSError) -> str:
    """Why the gateway cannot listen on host:port, in one line naming the flag to change."""
    if isinstance(exc, socket.gaierror):
        reason = f"unknown host ({exc.strerror or exc}; choose --host)"
    else:
        reason = _LISTEN_REASONS.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()
    return f"cannot listen on {host}:{port}: {reason}"


STORE_SCHEMES = {"state_url": ("postgresql", "postgres"), "redis_url": ("redis", "rediss", "unix")}


def check_store_urls(config: GatewayConfig) -> None:
    """A shared store's URL of the wrong kind stops the start, not the first request."""
    for name, schemes in STORE_SCHEMES.items():
        url = getattr(config, name)
        if url and url.split("://", 1)[0] not in schemes:
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"{flag} takes a {' or '.join(s + '://' for s in schemes)} URL, "
                             f"not {url.split('://', 1)[0]!r}...")


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


def _convert(f: dataclasses.Field, value: Any) -> Any:
    """A setting's value, from a flag's or a variable's text or a TOML value, as its field's
    type; ValueError saying what it takes."""
    kind = str(f.type)
    if "tuple" in kind:  # a list: repeated flags, a TOML list or comma-separated text
        items = value if isinstance(value, (list, tuple)) else str(value).split(",")
        return tuple(str(i).strip() for i in items if str(i).strip())
    if "bool" in kind:
        return _to_bool(value)
    if "int" in kind:
        return _to_number(value, int, "a whole number")
    if "float" in kind:
        return _to_number(value, float, "a number")
    if not isinstance(value, str):
        raise ValueError(f"takes text, not {value!r}")
    return value


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_WORDS or text in FALSE_WORDS:
        return text in TRUE_WORDS
    raise ValueError(f"takes true or false, not {value!r}")


def _to_number(value: Any, kind: type, name: str):
    if isinstance(value, bool) or (kind is int and isinstance(value, float)):
        raise ValueError(f"takes {name}, not {value!r}")
    try:
        return kind(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ValueError(f"takes {name}, not {value!r}") from None


def _setting(f: dataclasses.Field, value: Any, source: str) -> Any:
    """`_convert`, a bad value stopping the start with one line naming where it came from."""
    try:
        return _convert(f, value)
    except ValueError as exc:
        raise SystemExit(f"{source} {exc}") from None


def debug_requested(argv: list[str] | None = None,
                    environ: Mapping[str, str] | None = None) -> bool:
    """--debug (or INFERSTACK_DEBUG) as given, read before the settings are: a start error in
    reading them shows its traceback too."""
    for arg in reversed(sys.argv[1:] if argv is None else argv):
        if arg in ("--debug", "--no-debug"):
            return arg == "--debug"
    value = (os.environ if environ is None else environ).get("INFERSTACK_DEBUG", "")
    return value.strip().lower() in TRUE_WORDS


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise SystemExit(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SystemExit(f"--config {path}: not valid TOML: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gateway",
        description="OpenAI-compatible gateway over runtime worker processes. Every flag can "
                    "also be set as INFERSTACK_<NAME> in the environment or as <name> in a "
                    "TOML file given with --config; flags win over the environment, which wins "
                    "over the file.")
    p.add_argument("--config", help="a TOML file of settings")
    for f in gateway_fields():
        _add_flag(p, f, HELP[f.name])
    engine = p.add_argument_group("engine settings", "given to every worker")
    for f in fields(EngineSettings):
        _add_flag(engine, f, f.metadata["help"])
    return p


def gateway_fields() -> list[dataclasses.Field]:
    """The gateway's own settings (the engine's are `fields(EngineSettings)`)."""
    return [f for f in fields(GatewayConfig) if f.name != "engine"]


def flat_settings(config: GatewayConfig) -> dict:
    """Every setting by its flat name, as an operator gives it: the gateway's and the engine's."""
    values = {f.name: getattr(config, f.name) for f in gateway_fields()}
    return values | {f.name: getattr(config.engine, f.name) for f in fields(EngineSettings)}


def _add_flag(group, f: dataclasses.Field, help_text: str) -> None:
    """A flag whose default is None, so that load_config can tell a flag given from one not;
    its help names the setting's real default (`with_default`: once)."""
    flag = "--" + f.name.replace("_", "-")
    if help_text is not argparse.SUPPRESS:
        help_text = with_default(help_text, f.default)
    if "bool" in str(f.type):
        group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=help_text)
    elif "tuple" in str(f.type):
        group.add_argument(flag.removesuffix("s"), dest=f.name, action="append",
                           default=None, metavar=f.name.upper().removesuffix("S"),
                           help=help_text)
    else:
        group.add_argument(flag, dest=f.name, default=None, help=help_text)


def load_config(argv: list[str] | None = None,
                environ: Mapping[str, str] | None = None) -> GatewayConfig:
    args = build_parser().parse_args(argv)
    environ = os.environ if environ is None else environ
    values: dict = _read_toml(args.config) if args.config else {}
    by_name = {f.name: f for f in [*gateway_fields(), *fields(EngineSettings)]}
    unknown = set(values) - set(by_name)
    if unknown:
        raise SystemExit(f"unknown settings in {args.config}: {', '.join(sorted(unknown))}")
    for name in values:
        values[name] = _setting(by_name[name], values[name], f"{name} in {args.config}")
    for name, f in by_name.items():
        env = environ.get("INFERSTACK_" + name.upper())
        if env is not None:
            values[name] = _setting(f, env, "INFERSTACK_" + name.upper())
        arg = getattr(args, name)
        if arg is not None:
            values[name] = _setting(f, arg, "--" + name.replace("_", "-"))
    engine = EngineSettings(**{k: v for k, v in values.items() if k in _ENGINE_FIELDS})
    config = GatewayConfig(engine, **{k: v for k, v in values.items() if k not in _ENGINE_FIELDS})
    config.check_port()
    config.check_fleet()
    config.check_engine()
    refuse_open_keyless(config)
    check_store_urls(config)
    config.sampling_spec()  # refused now, not when the first worker is ready
    if config.reasoning_parser not in ("auto", *REASONING_PARSERS):
        raise SystemExit(f"--reasoning-parser takes auto, {', '.join(REASONING_PARSERS)}, "
                         f"not {config.reasoning_parser[:40]!r}")
    if config.tool_call_parser not in TOOL_CALL_PARSERS:
        raise SystemExit(f"--tool-call-parser takes {', '.join(TOOL_CALL_PARSERS)}, not "
                         f"{config.tool_call_parser[:40]!r}")
    check_batch(config)
    if config.log_format not in LOG_FORMATS:
        raise SystemExit(f"--log-format takes {' or '.join(LOG_FORMATS)}, not "
                         f"{config.log_format[:40]!r}")
    return config
