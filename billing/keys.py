"""API keys and tenants, from a TOML file. Keys are stored only as SHA-256 hashes.

    [tenants.acme]
    priority = 0                  # most urgent class its requests may use (lower is more urgent)
    weight = 2.0                  # fair-share weight within a priority class
    requests_per_minute = 600     # 0: unlimited
    tokens_per_minute = 200000    # prompt + max output tokens; 0: unlimited
    budget_usd = 50.0             # 0: unlimited
    budget_period = "day"         # day | month | total (UTC)
    models = ["*"]
    shared_cache = false          # may opt requests into the shared prefix-cache namespace
    max_running_share = 0.5       # most of the fleet's running slots it holds while others
                                  # wait, in (0, 1]; unset: --tenant-max-running-share

    [[keys]]
    sha256 = "<hex of sha256(key)>"   # python -m billing.keys hash KEY
    tenant = "acme"
    name = "acme-prod"
    admin = false
    metrics = false                   # may read /metrics (a key for Prometheus; admins may too)
    revoked = false

A malformed file stops the start with a message that names the line. SIGHUP rereads the file
(`billing/key_reload.py`); a malformed one then keeps the keys in use.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import sys
import tomllib
from dataclasses import dataclass

from contract.errors import StartError

PERIODS = ("day", "month", "total")


class KeyFileError(StartError, ValueError):
    """The key file cannot be used: one line naming the file (and the line, where there is
    one). It stops a start; a SIGHUP reload keeps the keys in use (billing/key_reload.py)."""


@dataclass(frozen=True)
class Tenant:
    name: str
    priority: int = 0
    weight: float = 1.0
    requests_per_minute: float = 0.0
    tokens_per_minute: float = 0.0
    budget_usd: float = 0.0
    budget_period: str = "day"
    models: tuple[str, ...] = ("*",)
    shared_cache: bool = False
    max_running_share: float | None = None  # None: the gateway's --tenant-max-running-share

    def allows_model(self, names: tuple[str, ...]) -> bool:
        """May use the model served under `names` (its name and aliases): one listed is enough."""
        return "*" in self.models or any(name in self.models for name in names)


@dataclass(frozen=True)
class ApiKey:
    sha256: str
    tenant: Tenant
    name: str
    admin: bool = False
    revoked: bool = False
    metrics: bool = False  # may read /metrics without being an admin

    @property
    def cache_salt(self) -> str:
        """The prefix-cache namespace of this key, derived from it and never from the client."""
        return hashlib.blake2b(b"prefix-cache|" + bytes.fromhex(self.sha256),
                               digest_size=16).hexdigest()


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, keys: list[ApiKey]):
        self._by_hash = {k.sha256: k for k in keys}
        self.tenants = {k.tenant.name: k.tenant for k in keys}

    @property
    def num_keys(self) -> int:
        return len(self._by_hash)

    def by_hash(self, sha256: str) -> ApiKey | None:
        """The key whose secret hashes to `sha256` (work recorded under a key, such as a
        batch, finds its key again after a key-file reload), or None."""
        return self._by_hash.get(sha256)

    def lookup(self, presented: str) -> ApiKey | None:
        """The key for a presented secret, or None (unknown or revoked)."""
        digest = hash_key(presented)
        key = self._by_hash.get(digest)
        if key is None or not hmac.compare_digest(key.sha256, digest) or key.revoked:
            return None
        return key

    @classmethod
    def single_admin(cls, secret: str, tenant: str = "default") -> KeyStore:
        """--api-key: one admin key (admins read /metrics too) of one unlimited tenant."""
        return cls([ApiKey(hash_key(secret), Tenant(tenant), "api-key", admin=True,
                           metrics=True)])

    @classmethod
    def from_toml(cls, path: str, served_models: tuple[str, ...] | None = None) -> KeyStore:
        """The keys of `path`; with `served_models`, a tenant naming a model not among them is
        an error (a typo there would refuse every request of that tenant)."""
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
            data = tomllib.loads(raw.decode())
        except tomllib.TOMLDecodeError as exc:
            raise KeyFileError(f"{path}: not valid TOML: {exc}") from None
        except OSError as exc:
            raise KeyFileError(f"{path}: cannot read the key file "
                               f"({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise KeyFileError(f"{path}: cannot read the key file (not UTF-8: {exc})") from None
        lines = raw.decode().splitlines()
        tenants = {name: _tenant(name, t, _where(path, lines, rf"\[\s*tenants\.{re.escape(name)}"
                                                                rf"\s*\]"), served_models)
                   for name, t in _table(data, "tenants", path).items()}
        keys = []
        for i, k in enumerate(_array(data, "keys", path)):
            keys.append(_key(k, tenants, _where(path, lines, r"\[\[\s*keys\s*\]\]", i)))
        if not keys:
            raise KeyFileError(f"{path}: no [[keys]] entries")
        return cls(keys)


def _where(path: str, lines: list[str], pattern: str, occurrence: int = 0) -> str:
    seen = 0
    for number, line in enumerate(lines, start=1):
        if re.match(pattern, line.strip()):
            if seen == occurrence:
                return f"{path}, line {number}"
            seen += 1
    return path


def _table(data: dict, name: str, path: str) -> dict:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise KeyFileError(f"{path}: [{name}] must be a table of tables")
    return value


def _array(data: dict, name: str, path: str) -> list:
    value = data.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise KeyFileError(f"{path}: {name} must be an array of tables ([[{name}]])")
    return value


def _tenant(name: str, t: dict, where: str, served: tuple[str, ...] | None) -> Tenant:
    if not isinstance(t, dict):
        raise KeyFileError(f"{where}: tenant {name!r} must be a table")
    known = set(Tenant.__dataclass_fields__) - {"name"}
    unknown = set(t) - known
    if unknown:
        raise KeyFileError(f"{where}: unknown tenant settings {sorted(unknown)}")
    try:
        tenant = Tenant(name=name, priority=int(t.get("priority", 0)),
                        weight=float(t.get("weight", 1.0)),
                        requests_per_minute=float(t.get("requests_per_minute", 0)),
                        tokens_per_minute=float(t.get("tokens_per_minute", 0)),
                        budget_usd=float(t.get("budget_usd", 0)),
                        budget_period=str(t.get("budget_period", "day")),
                        models=_models(t.get("models", ["*"])),
                        shared_cache=bool(t.get("shared_cache", False)),
                        max_running_share=_share(t.get("max_running_share")))
    except (TypeError, ValueError) as exc:
        raise KeyFileError(f"{where}: tenant {name!r}: {exc}") from None
    if tenant.weight <= 0:
        raise KeyFileError(f"{where}: tenant {name!r}: weight must be > 0")
    if min(tenant.requests_per_minute, tenant.tokens_per_minute, tenant.budget_usd) < 0:
        raise KeyFileError(f"{where}: tenant {name!r}: limits and budget must be >= 0")
    if tenant.budget_period not in PERIODS:
        raise KeyFileError(f"{where}: tenant {name!r}: budget_period must be one of {PERIODS}")
    unknown_models = [m for m in tenant.models if m != "*" and served and m not in served]
    if unknown_models:
        raise KeyFileError(f"{where}: tenant {name!r}: models {unknown_models} are not served "
                           f"here (served: {', '.join(served or ())}; see --served-model-name)")
    return tenant


def _share(value) -> float | None:
    """A share of the running batch: a number in (0, 1], or None when not set."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"max_running_share must be a number in (0, 1], not {value!r}")
    return float(value)


def _models(value) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise ValueError("models must be an array of model names (or [\"*\"])")
    return tuple(value)


def _key(k: dict, tenants: dict, where: str) -> ApiKey:
    digest = k.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise KeyFileError(f"{where}: sha256 must be 64 lowercase hex characters "
                           f"(python -m billing.keys hash KEY)")
    name = k.get("tenant")
    tenant = tenants.get(name) if isinstance(name, str) else None  # a list is unhashable
    if tenant is None:
        raise KeyFileError(f"{where}: tenant {name!r} is not defined "
                           f"under [tenants]")
    for flag in ("admin", "revoked", "metrics"):
        if not isinstance(k.get(flag, False), bool):
            raise KeyFileError(f"{where}: {flag} must be true or false")
    return ApiKey(digest, tenant, str(k.get("name", digest[:8])), k.get("admin", False),
                  k.get("revoked", False), k.get("metrics", False))


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "hash":
        print(hash_key(argv[1]))
        return 0
    if len(argv) == 2 and argv[0] == "check":
        try:
            store = KeyStore.from_toml(argv[1])
        except KeyFileError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{len(store._by_hash)} keys, tenants: {', '.join(sorted(store.tenants))}")
        return 0
    print("usage: python -m billing.keys hash KEY | check FILE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
