"""The prefix cache's second tier: evicted KV blocks kept in a bounded folder, keyed by hash.

Files are `<hash hex>.kv`: a magic, a JSON header (token ids, shape, dtype), the raw tensor
bytes and a BLAKE2b checksum of all that precedes it. A truncated or corrupted file fails the
checksum and is deleted, never served. Writes run on a background thread behind a bounded
queue, so the step loop never waits for the disk (a full queue drops the write). Any I/O
failure degrades to a cache miss with one logged warning per kind of failure.

Blocks hold tenants' prompts as KV, so every file is the owner's only (0600, a folder created
here 0700), whatever the process umask.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
MAGIC = b"INFKV001"
SUFFIX = ".kv"
CHECKSUM_BYTES = 32


@dataclass
class DiskCacheStats:
    reads: int = 0  # blocks served from disk
    writes: int = 0  # blocks written
    corrupt: int = 0  # files that failed their checksum and were deleted
    bytes_used: int = 0


def encode_block(token_ids: tuple[int, ...], kv: torch.Tensor) -> bytes:
    header = json.dumps({"tokens": list(token_ids), "shape": list(kv.shape),
                         "dtype": str(kv.dtype).removeprefix("torch.")}).encode()
    body = MAGIC + len(header).to_bytes(4, "little") + header + kv.contiguous().view(
        torch.uint8).numpy().tobytes()
    return body + hashlib.blake2b(body, digest_size=CHECKSUM_BYTES).digest()


def decode_block(data: bytes) -> tuple[tuple[int, ...], torch.Tensor]:
    """Inverse of encode_block; raises ValueError on any damage."""
    if len(data) < len(MAGIC) + 4 + CHECKSUM_BYTES or not data.startswith(MAGIC):
        raise ValueError("not a KV block file")
    body, checksum = data[:-CHECKSUM_BYTES], data[-CHECKSUM_BYTES:]
    if hashlib.blake2b(body, digest_size=CHECKSUM_BYTES).digest() != checksum:
        raise ValueError("checksum mismatch")
    n = int.from_bytes(body[8:12], "little")
    header = json.loads(body[12:12 + n])
    payload = bytearray(body[12 + n:])
    kv = torch.frombuffer(payload, dtype=getattr(torch, header["dtype"])).view(header["shape"])
    return tuple(header["tokens"]), kv


def _make_private(entry: os.DirEntry) -> None:
    """Tighten a block file written before files were private (or copied in with a wider mode)."""
    if entry.stat().st_mode & 0o077:
        os.chmod(entry.path, 0o600)


class DiskKVCache:
    def __init__(self, folder: str, max_bytes: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, queue_size: int = 256):
        self.folder = folder
        self.block_shape = tuple(block_shape)  # [layers, 2, block_size, kv_heads, head_dim]
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.stats = DiskCacheStats()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, LRU first
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._usable = self._open_folder()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()

    # ---- lookups (step thread) ----------------------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index

    def load(self, block_hash: bytes, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The block's KV if its file is intact and holds these tokens; else None."""
        if not self.contains(block_hash):
            return None
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                stored_tokens, kv = decode_block(f.read())
        except FileNotFoundError:
            self._warn("vanished", f"KV cache file vanished: {path}")
            self._forget(block_hash)
            return None
        except (ValueError, KeyError, TypeError, RuntimeError):
            self._warn("corrupt", f"corrupted KV cache file deleted: {path}")
            self.stats.corrupt += 1
            self._delete(block_hash)
            return None
        except OSError as exc:
            self._warn("read", f"KV cache read failed ({exc}); serving a miss")
            return None
        if stored_tokens != tuple(token_ids):
            return None  # a hash collision: never serve another prompt's KV
        if tuple(kv.shape) != self.block_shape or kv.dtype != self.dtype:
            self._warn("shape", f"KV cache file of another shape deleted: {path}")
            self._delete(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        self.stats.reads += 1
        return kv

    # ---- writes (background thread) -----------------------------------------------------
    def save_async(self, block_hash: bytes, token_ids: tuple[int, ...], kv: torch.Tensor) -> None:
        if not self._usable or self.contains(block_hash):
            return
        try:
            self._queue.put_nowait((block_hash, token_ids, kv))
        except queue.Full:
            pass  # the step loop never waits for the disk: this block will not persist

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued writes are on disk (tests and shutdown)."""
        done = threading.Event()
        self._queue.put((None, None, done), timeout=timeout)
        done.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            block_hash, tokens, kv = item
            if block_hash is None:
                kv.set()  # a flush marker
                continue
            self._write(block_hash, tokens, kv)

    def _write(self, block_hash: bytes, tokens: tuple[int, ...], kv: torch.Tensor) -> None:
        data = encode_block(tokens, kv)
        path = self._path(block_hash)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            # O_EXCL: a stale file of this name would keep its old, perhaps looser, mode
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            self._warn("write", f"KV cache write failed ({exc}); blocks will not persist")
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        with self._lock:
            self._index[block_hash] = len(data)
            self.stats.bytes_used += len(data)
        self.stats.writes += 1
        self._enforce_limit()

    # ---- housekeeping -------------------------------------------------------------------
    def _open_folder(self) -> bool:
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            entries = [e for e in os.scandir(self.folder) if e.name.endswith(SUFFIX)]
        except OSError as exc:
            self._warn("folder", f"KV cache folder {self.folder} unusable ({exc}); disk tier off")
            return False
        for e in sorted(entries, key=lambda e: e.stat().st_mtime):
            try:
                _make_private(e)
                self._index[bytes.fromhex(e.name[:-len(SUFFIX)])] = e.stat().st_size
                self.stats.bytes_used += e.stat().st_size
            except (ValueError, OSError):
                continue
        self._enforce_limit()
        return True

    def _enforce_limit(self) -> None:
        while True:
            with self._lock:
                if self.stats.bytes_used <= self.max_bytes or not self._index:
                    return
                oldest = next(iter(self._index))
            self._delete(oldest)

    def _delete(self, block_hash: bytes) -> None:
        self._forget(block_hash)
        try:
            os.unlink(self._path(block_hash))
        except OSError:
            pass

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.stats.bytes_used -= size

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.folder, block_hash.hex() + SUFFIX)

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)
