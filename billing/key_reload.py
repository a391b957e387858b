"""SIGHUP rereads the key file: a new `KeyStore` replaces `state.keys` in one assignment.

Handlers read `state.keys` once per request, so a swap takes effect for the next request and
a request never sees half of one file and half of another. A bad file keeps the keys in use.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from billing.keys import KeyFileError, KeyStore

log = logging.getLogger(__name__)


class HoldsKeys(Protocol):
    """Where the serving keys live (the gateway's state): what a reload replaces."""

    keys: KeyStore | None


def reload_keys(path: str, current: KeyStore,
                served_models: tuple[str, ...] | None = None) -> KeyStore:
    """The store built from `path`, or `current` when the file is bad (logged at ERROR)."""
    try:
        store = KeyStore.from_toml(path, served_models)
    except KeyFileError as exc:  # names the file and the line
        log.error("key file not reloaded, the old keys stay in use: %s", exc)
        return current
    except Exception as exc:  # noqa: BLE001 - a reload must never take the serving keys away
        log.error("%s: key file not reloaded, the old keys stay in use: %s: %s", path,
                  type(exc).__name__, " ".join(str(exc).split()))
        log.debug("the reload's traceback", exc_info=True)
        return current
    log.info("%s reloaded: %d keys, tenants %s", path, store.num_keys,
             ", ".join(sorted(store.tenants)))
    return store


class KeyReloader:
    """The SIGHUP handler: one reload at a time, read off the event loop.

    A signal during a reload asks for one more after it, so the file as it was at the last
    signal is the one that ends up loaded; further signals meanwhile fold into that one.
    """

    def __init__(self, holder: HoldsKeys, path: str,
                 served_models: tuple[str, ...] | None = None):
        self.holder = holder
        self.path = path
        self.served_models = served_models  # a new file is checked against these names
        self.task: asyncio.Task | None = None
        self._again = False

    def __call__(self) -> None:
        if self.task is not None and not self.task.done():
            self._again = True
            return
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self._again = False
            current = self.holder.keys
            self.holder.keys = await asyncio.to_thread(reload_keys, self.path, current,
                                                      self.served_models)
            if not self._again:
                return
