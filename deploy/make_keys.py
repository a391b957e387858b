"""`make deploy-keys` (python3 deploy/make_keys.py deploy/keys.toml): the key file that
deploy/docker-compose.yml mounts into both gateways, with one admin key.

Why a step of its own: Compose bind-mounts a missing file as an empty directory, and a
gateway given a directory as --keys-file cannot start. The compose file now refuses to start
without the file (its bind mount does not create the path); this makes one to start from.
The key is printed once and only its SHA-256 is written (as `python -m billing.keys hash`
computes it), so the file may be shared with the gateways' hosts. Add tenants and keys as the
README's key file section says; an existing file is never overwritten.

Standard library only: it runs before any venv or image exists.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import sys

TEMPLATE = """\
# API keys and tenants of the gateways (README, "Tenants and money"); made by make deploy-keys.
# `docker compose kill -s HUP gateway-a gateway-b` rereads this file after an edit.
[tenants.admin]
priority = 0

[[keys]]
sha256 = "{digest}"
tenant = "admin"
name = "admin"
admin = true
"""


def make(path: str) -> str:
    """Writes the file (owner-only) and returns the new admin key; refuses an existing path."""
    key = "sk-" + secrets.token_urlsafe(32)
    digest = hashlib.sha256(key.encode()).hexdigest()
    # O_EXCL: never replace a file (or follow a directory Compose may have made in its place)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(TEMPLATE.format(digest=digest))
    return key


def main(argv: list[str]) -> int:
    path = argv[0] if argv else os.path.join(os.path.dirname(__file__), "keys.toml")
    if os.path.isdir(path):
        print(f"{path} is a directory (left by a compose run without the file): remove it "
              f"with rmdir, then run this again", file=sys.stderr)
        return 1
    try:
        key = make(path)
    except FileExistsError:
        print(f"{path} exists already: kept as it is", file=sys.stderr)
        return 0
    print(f"wrote {path} with one admin key (shown once, only its hash is stored):\n{key}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
