"""Writes a gateway key file (README format) for tests: tenants, then keys by secret."""
from __future__ import annotations

from billing.keys import hash_key


def write_key_file(path, tenants: dict, keys: list[tuple]) -> str:
    """`tenants`: name -> settings; `keys`: (secret, tenant, admin, revoked[, metrics])."""
    lines = []
    for name, settings in tenants.items():
        lines.append(f"[tenants.{name}]")
        lines += [f"{k} = {v}" for k, v in settings.items()]
        lines.append("")
    for secret, tenant, admin, revoked, *metrics in keys:
        lines += ["[[keys]]", f'sha256 = "{hash_key(secret)}"', f'tenant = "{tenant}"',
                  f'name = "{secret}"', f"admin = {str(admin).lower()}",
                  f"revoked = {str(revoked).lower()}"]
        lines += ["metrics = true"] if metrics and metrics[0] else []
        lines.append("")
    path.write_text("\n".join(lines))
    return str(path)
