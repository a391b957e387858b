"""The engine settings a worker takes, declared once: name, default, help text and the
`EngineConfig` field each one fills.

Everything else is generated from `EngineSettings`: the worker's flags
(`runtime/transport/worker.py`), the gateway's settings of the same names and the argv it starts
workers with (`gateway/config.py`), and the `EngineConfig` a worker builds. So a flag name or a
default cannot drift between the three. The numbers themselves stay `EngineConfig`'s: each default
below is read from it, so the engine used directly (tests, benchmarks) agrees as well.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from contract.config import EngineConfig
from contract.errors import StartError
from contract.tokenizer import load_chat_template

GIB = 1 << 30
_ENGINE = EngineConfig()  # the engine's own defaults, the one place the numbers are written


def _gib_to_bytes(gib: float) -> int:
    return int(gib * GIB)


def setting(default: Any, help: str, engine: str | None = None,
            to_engine: Callable[[Any], Any] | None = None) -> Any:
    """A setting with its default and help; it fills `EngineConfig.<engine>` (by default the
    field of the same name) with `to_engine(value)` (by default the value itself)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "engine": engine, "to_engine": to_engine or (lambda value: value)})


@dataclass(frozen=True)
class EngineSettings:
    """What a worker's engine is told. Field types are annotations as strings (postponed), read
    by the flag builders below: bool becomes a switch, int and float typed values."""

    device: str = setting(_ENGINE.device, "cpu or cuda")
    thread_policy: str = setting(_ENGINE.thread_policy,
                                 "CPU threads: adaptive (measured, fewer when a neighbour "
                                 "takes a core) or fixed (--threads)")
    quantization: str = setting(_ENGINE.quantization,
                                "weights: auto (a quantized GGUF stays quantized on a vectorized "
                                "CPU: int4 for a 4-bit file where the compiled CPU kernels run, "
                                "else int8; float weights and CUDA stay float), none, int8 or "
                                "int4")
    kv_cache_dtype: str = setting(_ENGINE.kv_cache_dtype,
                                  "KV-cache elements: auto (float16 under a float32 model on "
                                  "the CPU, else the model's dtype), float32, float16, "
                                  "bfloat16, or int8 (CPU: each row's values in 8 bits with "
                                  "a float32 scale, about 1.9x the tokens of float16)")
    overlap: str = setting(_ENGINE.overlap,
                           "plan each step while the last one runs: auto (on CUDA), on or off")
    kv_cache_gb: float = setting(_ENGINE.kv_cache_bytes / GIB, "KV-cache memory per worker, GiB",
                                 "kv_cache_bytes", _gib_to_bytes)
    max_num_seqs: int = setting(_ENGINE.max_num_seqs, "running requests per worker")
    max_model_len: int | None = setting(_ENGINE.max_model_len,
                                        "the longest prompt plus output of a request, in "
                                        "tokens (longer ones get 400); at most the model's "
                                        "context (default: the model's context)")
    max_num_batched_tokens: int = setting(_ENGINE.max_num_batched_tokens,
                                          "token budget per engine step")
    itl_target_ms: float | None = setting(
        _ENGINE.itl_target_ms,
        "while requests decode, cap each step's prompt (prefill) tokens so the step fits "
        "this many ms, keeping their inter-token gaps at the cost of a later first token; "
        "0 (the default) leaves the cap off")
    prefix_caching: bool = setting(_ENGINE.enable_prefix_caching,
                                   "reuse KV of repeated prompt prefixes", "enable_prefix_caching")
    disk_cache_dir: str | None = setting(_ENGINE.disk_cache_dir,
                                         "folder for the prefix cache's disk tier")
    spec: str = setting(_ENGINE.spec, "speculative decoding: off, ngram, self:L, draft:PATH or "
                        "mtp[:K] (the checkpoint's multi-token-prediction layer, K drafts)")
    num_spec_tokens: int = setting(_ENGINE.num_spec_tokens,
                                   "the most tokens proposed per request per step")
    chat_template: str | None = setting(_ENGINE.chat_template,
                                        "a Jinja chat template file (or the template text "
                                        "itself) replacing the model's (default: the model's)")

    def engine_config(self) -> EngineConfig:
        """The EngineConfig these settings describe; its other fields keep their defaults."""
        values = {}
        for f in fields(EngineSettings):
            values[f.metadata["engine"] or f.name] = f.metadata["to_engine"](getattr(self, f.name))
        return EngineConfig(**values)

    def worker_flags(self) -> list[str]:
        """The worker argv that reproduces these settings. Values travel even at their default
        (a worker's command line then shows its whole engine); a switch only when moved off it,
        as a worker has just the one flag that moves it."""
        argv: list[str] = []
        for f in fields(EngineSettings):
            value = getattr(self, f.name)
            if _is_switch(f):
                if value != f.default:
                    argv.append(_switch_flag(f))
            elif value is not None:
                argv += [_flag(f), str(value)]
        return argv


def check_on_this_host(settings: EngineSettings, fake: bool = False) -> None:
    """Raise StartError (one line naming the flag) for settings this machine cannot serve: a
    CUDA device under a CPU-only torch, a disk-cache folder that cannot be written, a chat
    template that cannot be read or does not compile. Run by the gateway before it starts a
    worker here and by each worker before it loads its model, without importing torch (a
    worker's engine then finds out whether a GPU is actually visible). `fake`: the fake
    engine, which uses no device."""
    if not fake and settings.device.startswith("cuda") and not torch_build_has_gpu():
        raise StartError(f"--device {settings.device}: the installed torch "
                         f"({_torch_version() or 'unknown version'}) is a CPU-only build; "
                         f"install a CUDA build of torch, or use --device cpu")
    if settings.disk_cache_dir and settings.prefix_caching:
        check_writable_folder(settings.disk_cache_dir, "--disk-cache-dir")
    load_chat_template(settings.chat_template)


def check_writable_folder(folder: str, flag: str) -> None:
    """Create `folder` if needed and write a file there, or a StartError naming `flag`."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as e:
        raise StartError(f"{flag} {folder}: cannot write there ({e.strerror or e}); choose a "
                         f"writable folder") from e


def torch_build_has_gpu() -> bool:
    """Whether the installed torch was built for CUDA or ROCm, read from its version.py (the
    gateway never imports torch); True when that cannot be told, so only a build known to be
    CPU-only is refused."""
    values = _torch_version_values()
    if values is None:
        return True
    return values.get("cuda") is not None or values.get("hip") is not None


def _torch_version() -> str | None:
    values = _torch_version_values()
    return values.get("__version__") if values else None


def _torch_version_values() -> dict[str, Any] | None:
    """The constants of torch/version.py (`cuda = None`, `__version__ = '2.13.0+cpu'`)."""
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
            text = f.read()
    except OSError:
        return None
    values: dict[str, Any] = {}
    for name, literal in re.findall(r"^(\w+)\s*(?::[^=\n]*)?=\s*(.+)$", text, re.MULTILINE):
        try:
            values[name] = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError):
            pass
    return values


def with_default(help_text: str, default: Any) -> str:
    """A flag's help naming its default once, the one rule for every parser of these settings
    (the gateway's and the worker's): a help text that describes its default in words keeps
    it ("(default: the model's context)"), an empty default (None, no items: not set) is
    not named, any other default is appended."""
    if default is None or default in ((), "") or "(default" in help_text:
        return help_text
    return f"{help_text} (default: {default})"


def _is_switch(f: dataclasses.Field) -> bool:
    return f.type == "bool"


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _switch_flag(f: dataclasses.Field) -> str:
    """A worker's switch names the change from the default: --no-prefix-caching."""
    return _flag(f).replace("--", "--no-", 1) if f.default else _flag(f)


def _value_type(f: dataclasses.Field) -> type:
    return {"int": int, "float": float}.get(f.type.split(" | ")[0], str)


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """The worker's flags for every engine setting, with the declared defaults."""
    for f in fields(EngineSettings):
        help_text = f.metadata["help"]
        if _is_switch(f):
            parser.add_argument(_switch_flag(f), dest=f.name, default=f.default,
                                action="store_false" if f.default else "store_true",
                                help=("turn off: " if f.default else "turn on: ") + help_text)
        else:
            parser.add_argument(_flag(f), dest=f.name, type=_value_type(f), default=f.default,
                                help=with_default(help_text, f.default))


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    """The settings parsed by a parser that `add_worker_flags` filled."""
    return EngineSettings(**{f.name: getattr(args, f.name) for f in fields(EngineSettings)})
