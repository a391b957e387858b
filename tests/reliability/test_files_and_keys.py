"""Private files and live key reloads: the ledger and the disk cache are the owner's only under
a normal umask, and SIGHUP swaps in a new key file (or keeps the old keys when it is bad)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from billing import key_reload
from billing.key_reload import KeyReloader, reload_keys
from billing.keys import KeyStore
from billing.ledger import Ledger
from runtime.kv.disk_cache import DiskKVCache, encode_block
from tests.gateway.keyfile import write_key_file
from tests.reliability.conftest import KEYS, TENANTS, Gateway

PING = {"prompt": "ping", "max_tokens": 2}
NEW_KEY = ("sk-new", "beta", False, False)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def normal_umask():
    """A normal user's shell: files the code does not restrict come out 0644, folders 0755."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def gateway(tmp_path, normal_umask):
    """A gateway of its own: these cases rewrite its key file and signal it."""
    server = Gateway(tmp_path)
    yield server
    server.stop()


def swap_key_file(gw: Gateway, keys: list, tenants: dict = TENANTS) -> None:
    """Replace the key file in one rename, as a deploy would: no reader sees half a file."""
    staged = write_key_file(Path(gw.keys_path).with_suffix(".staged"), tenants, keys)
    os.replace(staged, gw.keys_path)


def sighup(gw: Gateway) -> None:
    os.kill(gw.proc.pid, signal.SIGHUP)


def status(gw: Gateway, key: str) -> int:
    return gw.post_json("/v1/completions", PING, key=key)[0]


def wait_for_status(gw: Gateway, key: str, want: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := status(gw, key)) != want:
        assert gw.proc.poll() is None, "the gateway died"
        assert time.monotonic() < deadline, f"{key}: {got}, not {want}"
        time.sleep(0.1)


# ---- private files --------------------------------------------------------------------------
def test_ledger_and_its_wal_and_shm_are_private(gateway):
    for key in ("sk-alpha", "sk-beta", "sk-vip"):
        assert status(gateway, key) == 200
    files = [gateway.ledger_path + suffix for suffix in ("", "-wal", "-shm")]
    for path in files:  # the writer's connection keeps the WAL pair open
        assert os.path.exists(path), path
        assert mode(path) == 0o600, (path, oct(mode(path)))
    gateway.assert_baseline()


def test_an_existing_ledger_is_tightened_and_a_new_folder_is_private(tmp_path, normal_umask):
    old = str(tmp_path / "old.sqlite3")
    db = sqlite3.connect(old)  # an earlier run's files: 0644, with its WAL pair still there
    db.execute("PRAGMA journal_mode=WAL")
    with db:
        db.execute("CREATE TABLE t (x)")
    assert mode(old) == 0o644 and mode(old + "-wal") == 0o644
    ledger = Ledger(old)
    try:
        assert [mode(old + s) for s in ("", "-wal", "-shm")] == [0o600] * 3
    finally:
        ledger.close()
        db.close()
    nested = tmp_path / "fresh" / "ledger.sqlite3"
    Ledger(str(nested)).close()
    assert mode(nested.parent) == 0o700 and mode(nested) == 0o600


def test_disk_cache_folder_and_blocks_are_private(tmp_path, normal_umask):
    shape = (1, 2, 4, 1, 8)
    folder = tmp_path / "cache" / "kv"
    cache = DiskKVCache(str(folder), 1 << 20, shape, torch.float32)
    for i in range(3):
        cache.save_async(bytes([i]) * 16, (i, i, i, i), torch.full(shape, float(i)))
    cache.flush()
    cache.close()
    blocks = sorted(folder.iterdir())
    assert len(blocks) == 3 and cache.stats.writes == 3  # no temporary file is left behind
    assert mode(folder) == 0o700
    assert {p.name: mode(p) for p in blocks} == {p.name: 0o600 for p in blocks}
    # a block from before files were private is tightened when the folder is opened again
    stale = folder / ((b"\x09" * 16).hex() + ".kv")
    stale.write_bytes(encode_block((9, 9, 9, 9), torch.zeros(shape)))
    assert mode(stale) == 0o644
    again = DiskKVCache(str(folder), 1 << 20, shape, torch.float32)
    again.close()
    assert mode(stale) == 0o600 and again.contains(b"\x09" * 16)


# ---- SIGHUP reloads the key file ------------------------------------------------------------
def test_sighup_adds_and_removes_keys_without_a_restart(gateway):
    pid = gateway.proc.pid
    assert status(gateway, "sk-new") == 401 and status(gateway, "sk-beta") == 200
    kept = [k for k in KEYS if k[0] != "sk-beta"]
    swap_key_file(gateway, kept + [NEW_KEY])
    sighup(gateway)
    wait_for_status(gateway, "sk-new", 200)
    assert status(gateway, "sk-beta") == 401
    assert status(gateway, "sk-alpha") == 200
    assert gateway.proc.poll() is None and gateway.proc.pid == pid
    gateway.assert_baseline()


BROKEN = {
    "syntax error": lambda path: path.write_text("[[keys]\nsha256 = \n"),
    "unknown tenant": lambda path: write_key_file(path, TENANTS,
                                                  KEYS + [("sk-ghost", "ghost", False, False)]),
    "unreadable": lambda path: path.write_bytes(b"[tenants.\xff\xfe]\n"),
    "missing": lambda path: path.unlink(),
}


def test_sighup_with_a_broken_file_keeps_the_old_keys(gateway):
    path = Path(gateway.keys_path)
    for what, breaks in BROKEN.items():
        breaks(path)
        sighup(gateway)
        time.sleep(0.5)  # a reload reads a small file: long done by now
        assert gateway.proc.poll() is None, f"{what}: the gateway died"
        for key in ("sk-alpha", "sk-beta", "sk-admin"):
            assert status(gateway, key) == 200, what
        assert status(gateway, "sk-ghost") == 401, what
    swap_key_file(gateway, KEYS + [NEW_KEY])  # a good file after the bad ones still loads
    sighup(gateway)
    wait_for_status(gateway, "sk-new", 200)
    gateway.assert_baseline()


def test_rapid_sighups_end_with_the_last_file_whole(gateway):
    generations = [KEYS + [(f"sk-gen-{i}", "alpha", False, False)] for i in range(8)]
    for keys in generations:  # each signal may land while the last reload is still reading
        swap_key_file(gateway, keys)
        sighup(gateway)
    wait_for_status(gateway, "sk-gen-7", 200)
    time.sleep(0.5)  # any reload still running would land now
    assert status(gateway, "sk-gen-7") == 200
    for i in range(7):
        assert status(gateway, f"sk-gen-{i}") == 401, i
    for secret, want in (("sk-alpha", 200), ("sk-admin", 200), ("sk-revoked", 401)):
        assert status(gateway, secret) == want, secret
    gateway.assert_baseline()


def test_reload_keys_logs_the_file_and_line_and_keeps_the_store(tmp_path, caplog):
    path = tmp_path / "keys.toml"
    current = KeyStore.from_toml(write_key_file(path, TENANTS, KEYS))
    write_key_file(path, TENANTS, KEYS + [("sk-ghost", "ghost", False, False)])
    with caplog.at_level(logging.INFO, logger="billing.key_reload"):
        assert reload_keys(str(path), current) is current
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    lines = path.read_text().splitlines()
    header = lines.index('tenant = "ghost"') - 2 + 1  # its [[keys]] line, counted from 1
    assert lines[header - 1] == "[[keys]]"
    assert f"{path}, line {header}" in record.getMessage() and "'ghost'" in record.getMessage()
    assert reload_keys(str(tmp_path / "missing.toml"), current) is current
    good = write_key_file(tmp_path / "good.toml", TENANTS, KEYS + [NEW_KEY])
    assert reload_keys(good, current).lookup("sk-new") is not None


def test_signals_during_a_reload_fold_into_one_more_read(tmp_path, monkeypatch):
    running, reads = [0], []  # per read: how many were running, itself included

    def slow_reload(path, current, served_models=None):
        running[0] += 1
        reads.append(running[0])
        store = KeyStore.from_toml(path, served_models)
        time.sleep(0.3)
        running[0] -= 1
        return store

    monkeypatch.setattr(key_reload, "reload_keys", slow_reload)
    path = tmp_path / "keys.toml"
    state = SimpleNamespace(keys=None)

    async def main():
        reloader = KeyReloader(state, str(path))
        write_key_file(path, TENANTS, KEYS)
        reloader()
        await asyncio.sleep(0.1)  # the first read is running
        write_key_file(path, TENANTS, KEYS + [NEW_KEY])
        reloader()
        reloader()
        await reloader.task
    asyncio.run(main())
    assert reads == [1, 1]  # two reads, never side by side
    assert state.keys.lookup("sk-new") is not None  # the file as of the last signal
