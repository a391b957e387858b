"""deploy/docker-compose.yml, checked without Docker: valid against the Compose Specification's
JSON schema (the copy check-jsonschema ships, Apache-2.0), every file it builds from or mounts
exists, and the one file that is yours to make, deploy/keys.toml, is made by `make
deploy-keys` and is never replaced by a directory when it is missing.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from ruamel.yaml import YAML

from billing.keys import KeyFileError, KeyStore, hash_key

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# made per deployment, not kept in the repository: the documented step makes it
MADE_BY_STEP = {DEPLOY / "keys.toml": "deploy-keys"}


def compose() -> dict:
    """The file as Compose reads it: YAML 1.2, anchors and merge keys resolved."""
    return YAML(typ="safe").load((DEPLOY / "docker-compose.yml").read_text())


def compose_schema() -> dict:
    vendored = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor"
    return json.loads((vendored / "compose-spec.json").read_text())


def mounts(service: dict) -> list[dict]:
    """A service's volumes in the long form (the short `SRC:DST[:MODE]` converted)."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out.append(v)
            continue
        source, target, *mode = v.split(":")
        kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        out.append({"type": kind, "source": source, "target": target,
                    "read_only": mode == ["ro"], "short": True})
    return out


def test_the_file_is_valid_against_the_compose_specification():
    errors = sorted(Draft202012Validator(compose_schema()).iter_errors(compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_the_image_builds_from_files_that_exist():
    for name, service in compose()["services"].items():
        build = service.get("build")
        if build is None:
            continue
        context = (DEPLOY / build["context"]).resolve()
        assert context == ROOT, f"{name} builds from {context}, not the repository root"
        assert (context / build["dockerfile"]).is_file(), build


def test_every_mounted_file_exists_or_is_made_by_the_documented_step():
    declared = set(compose().get("volumes") or {})
    for name, service in compose()["services"].items():
        for m in mounts(service):
            if m["type"] == "volume":
                assert m["source"] in declared, f"{name}: volume {m['source']} not declared"
                continue
            source = (DEPLOY / m["source"]).resolve()
            if source in MADE_BY_STEP:
                # Compose would make a missing path a directory; the long form with
                # create_host_path off makes `up` fail with one line instead
                assert not m.get("short") and m["bind"]["create_host_path"] is False, m
                continue
            assert source.exists(), f"{name} mounts {m['source']}, which does not exist"


def test_the_gateways_read_the_mounted_key_file():
    for name, service in compose()["services"].items():
        command = service.get("command", [])
        if "--keys-file" not in command:
            continue
        path = command[command.index("--keys-file") + 1]
        assert path in {m["target"] for m in mounts(service)}, f"{name}: {path} not mounted"


def _make_keys():
    spec = importlib.util.spec_from_file_location("make_keys", DEPLOY / "make_keys.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_step_makes_a_key_file_the_gateway_loads(tmp_path, capsys):
    makefile = (ROOT / "Makefile").read_text()
    for path, target in MADE_BY_STEP.items():
        recipe = re.search(rf"^{target}:.*\n\t(.+)", makefile, re.M)
        assert recipe and f"deploy/make_keys.py {path.relative_to(ROOT)}" in recipe.group(1)
        assert f"make {target}" in (DEPLOY / "docker-compose.yml").read_text()
        assert f"make {target}" in (ROOT / "README.md").read_text()
    make_keys = _make_keys()
    keys = tmp_path / "keys.toml"
    assert make_keys.main([str(keys)]) == 0
    key = capsys.readouterr().out.split()[-1]
    store = KeyStore.from_toml(str(keys))
    admin = store._by_hash[hash_key(key)]
    assert admin.admin and key not in keys.read_text()
    assert keys.stat().st_mode & 0o077 == 0, "the key file is owner-only"
    before = keys.read_text()
    assert make_keys.main([str(keys)]) == 0 and keys.read_text() == before  # never replaced


def test_a_directory_in_place_of_the_key_file_is_one_line(tmp_path, capsys):
    """What a compose run with the short mount form leaves: the step says how to clear it, and
    a gateway given it gets one line, not a traceback (KeyFileError)."""
    folder = tmp_path / "keys.toml"
    folder.mkdir()
    assert _make_keys().main([str(folder)]) == 1
    assert "rmdir" in capsys.readouterr().err
    with pytest.raises(KeyFileError) as err:
        KeyStore.from_toml(str(folder))
    assert str(folder) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.subprocess
def test_a_gateway_given_a_directory_as_its_key_file_stops_with_one_line(tmp_path):
    """The second line of defence, for a directory an older compose run left: the gateway
    stops at once with one line naming the flag and the path (no crash loop of tracebacks)."""
    folder = tmp_path / "keys.toml"
    folder.mkdir()
    done = subprocess.run([sys.executable, "-m", "gateway", "--fake", "--port", "0",
                           "--keys-file", str(folder)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0
    assert len(lines) == 1 and "--keys-file" in lines[0] and str(folder) in lines[0], lines
