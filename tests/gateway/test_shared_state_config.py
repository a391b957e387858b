"""--state-url and --redis-url as every setting is given (flag, INFERSTACK_*, TOML), URLs of the
wrong kind refused at start, and without them the embedded stores, with neither asyncpg nor
redis loaded. No server is needed."""
from __future__ import annotations

import subprocess
import sys

import pytest

from billing.embedded_stores import EmbeddedBudgets, EmbeddedLimits
from billing.store_factory import budget_store, limit_store, outbox_path
from gateway.config import load_config

PG = "postgresql://gw:secret@db.internal:5432/billing"
REDIS = "redis://cache.internal:6379/2"


def test_the_urls_come_from_flags_the_environment_or_a_file(tmp_path):
    flags = load_config(["--state-url", PG, "--redis-url", REDIS], environ={})
    env = load_config([], environ={"INFERSTACK_STATE_URL": PG, "INFERSTACK_REDIS_URL": REDIS})
    toml = tmp_path / "gw.toml"
    toml.write_text(f'state_url = "{PG}"\nredis_url = "{REDIS}"\n')
    file = load_config(["--config", str(toml)], environ={})
    for config in (flags, env, file):
        assert (config.state_url, config.redis_url) == (PG, REDIS)
    wins = load_config(["--config", str(toml), "--state-url", "postgres://other/db"],
                       environ={"INFERSTACK_STATE_URL": "postgresql://env/db"})
    assert wins.state_url == "postgres://other/db"  # flag over environment over file
    assert load_config([], environ={}).state_url is None


@pytest.mark.parametrize("flag, url", [("--state-url", "mysql://db/x"),
                                       ("--state-url", "redis://cache:6379"),
                                       ("--redis-url", "postgresql://db/x"),
                                       ("--redis-url", "memcached://cache")])
def test_a_url_of_the_wrong_kind_stops_the_start(flag, url):
    with pytest.raises(SystemExit, match=flag):
        load_config([flag, url], environ={})


def test_without_urls_the_stores_are_embedded_and_load_no_client():
    script = ("import sys, tempfile, os\n"
              "from billing.store_factory import budget_store, limit_store\n"
              "b = budget_store(os.path.join(tempfile.mkdtemp(), 'l.sqlite3'))\n"
              "l = limit_store(1000.0)\n"
              "print(type(b).__name__, type(l).__name__,\n"
              "      'asyncpg' in sys.modules, 'redis' in sys.modules)\n"
              "b.ledger.close()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == ["EmbeddedBudgets", "EmbeddedLimits", "False", "False"]


def test_the_shared_stores_are_chosen_by_their_urls(tmp_path):
    ledger = str(tmp_path / "ledger.sqlite3")
    budgets, limits = budget_store(ledger, PG), limit_store(500.0, REDIS)
    assert type(budgets).__name__ == "PgBudgets" and budgets.url == PG
    assert budgets.outbox.path == outbox_path(ledger) != ledger
    assert type(limits).__name__ == "RedisLimits" and limits.tokens_per_second == 500.0
    embedded = budget_store(ledger)
    assert isinstance(embedded, EmbeddedBudgets) and embedded.ledger.path == ledger
    assert isinstance(limit_store(500.0), EmbeddedLimits)
    embedded.ledger.close()
