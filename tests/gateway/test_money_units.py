"""Price book, budgets, buckets, fair share, key files and the economics, without a server."""
import datetime as dt

import pytest

from billing.budget import BudgetBook, BudgetExceeded
from billing.economics import DEEPSEEK_PUBLISHED, deepseek_day
from billing.fairshare import FairShare
from billing.keys import KeyFileError, KeyStore, Tenant, hash_key
from billing.pricing import PriceBook, PriceBookError
from billing.ratelimit import RateLimiter


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_presets_and_cost_split():
    book = PriceBook.preset("deepseek-r1")
    c = book.cost(hit_tokens=1_000_000, miss_tokens=2_000_000, output_tokens=500_000)
    assert (c.cache_hit_input, c.cache_miss_input, c.output) == pytest.approx((0.14, 1.10, 1.095))
    assert c.total == pytest.approx(2.335)
    assert PriceBook.preset("seed").cost(0, 0, 1_000_000).total == pytest.approx(0.60)


def test_time_of_day_windows_wrap_midnight():
    book = PriceBook.from_dict({"preset": "deepseek-v3", "windows": [
        {"start": "16:30", "end": "00:30", "multiplier": 0.5}]})
    at = lambda h, m: dt.datetime(2026, 1, 1, h, m, tzinfo=dt.UTC)  # noqa: E731
    assert book.multiplier(at(12, 0)) == 1.0
    assert book.multiplier(at(16, 30)) == 0.5 and book.multiplier(at(0, 29)) == 0.5
    assert book.multiplier(at(0, 30)) == 1.0
    with pytest.raises(PriceBookError):
        PriceBook.from_dict({"windows": [{"start": "25:00", "end": "01:00", "multiplier": 1}]})
    with pytest.raises(PriceBookError):
        PriceBook.from_dict({"output": -1})


def test_budget_reservations_never_overspend_and_settle_back():
    tenant = Tenant("t", budget_usd=1.0)
    book = BudgetBook()
    held = [book.reserve(tenant, 0.3) for _ in range(3)]
    with pytest.raises(BudgetExceeded):
        book.reserve(tenant, 0.2)
    book.settle(held[0], 0.05)
    book.settle(held[0], 0.05)  # settling twice changes nothing
    assert book.reserve(tenant, 0.2)
    _, acct = book.account(tenant)
    assert acct.spent == pytest.approx(0.05) and acct.reserved == pytest.approx(0.8)


def test_budget_reads_spending_from_the_ledger():
    book = BudgetBook(spent_since=lambda tenant, since: 0.9)
    with pytest.raises(BudgetExceeded):
        book.reserve(Tenant("t", budget_usd=1.0), 0.2)


def test_token_buckets_wait_and_refund():
    clock = Clock()
    limiter = RateLimiter(clock)
    tenant = Tenant("t", requests_per_minute=2, tokens_per_minute=600)
    def take(tokens):  # what admission does: the request first, then its tokens
        return limiter.take_request(tenant) or limiter.take_tokens(tenant, tokens)

    assert take(100) == 0 and take(100) == 0
    assert limiter.take_request(tenant) == pytest.approx(30.0)  # a request refills in 30 s
    clock.t += 30  # one request and 300 tokens back (capped at 600)
    assert take(450) == 0  # leaves 150 tokens and no request
    clock.t += 30
    assert take(450) == pytest.approx(0.0)  # 150 + 300 = 450
    clock.t += 60
    limiter.take_tokens(tenant, 500)  # 600 - 500 = 100 left
    limiter.refund(tenant, 200)  # the request used less than it was charged
    assert limiter.buckets(tenant)[1].level == pytest.approx(300)
    assert limiter.take_tokens(Tenant("u", tokens_per_minute=10), 11) == float("inf")


def test_fair_share_interleaves_by_weight():
    clock = Clock()
    fair = FairShare(tokens_per_second=100, clock=clock)
    starts = sorted([(fair.start("a", 1.0, 10), "a") for _ in range(4)] +
                    [(fair.start("b", 3.0, 10), "b") for _ in range(12)])
    first_eight = [name for _, name in starts[:8]]
    assert first_eight.count("b") == 6 and first_eight.count("a") == 2
    fair.correct("b", 3.0, 10, 0)
    assert fair.virtual["b"] >= clock.t


KEYS = """
[tenants.acme]
weight = 2.0
budget_usd = 5

[[keys]]
sha256 = "{h}"
tenant = "acme"
name = "acme-prod"
"""


def test_key_file_loads_and_hides_secrets(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(KEYS.format(h=hash_key("sk-acme")))
    store = KeyStore.from_toml(str(path))
    key = store.lookup("sk-acme")
    assert key.tenant.name == "acme" and key.tenant.weight == 2.0
    assert store.lookup("sk-other") is None
    assert len(key.cache_salt) == 32 and "sk-acme" not in key.cache_salt


@pytest.mark.parametrize("text, line", [
    ('[tenants.a]\nweight = 1\n\n[[keys]]\nsha256 = "xyz"\ntenant = "a"\n', 4),
    ('[tenants.a]\nweight = 1\n\n[[keys]]\nsha256 = "{h}"\ntenant = "nobody"\n', 4),
    ('[tenants.a]\nweight = -1\n\n[[keys]]\nsha256 = "{h}"\ntenant = "a"\n', 1),
    ('[tenants.a]\nbudget_period = "week"\n[[keys]]\nsha256 = "{h}"\ntenant = "a"\n', 1),
    ('[tenants.a]\nweight = = 1\n', 2),
])
def test_malformed_key_file_names_the_line(tmp_path, text, line):
    path = tmp_path / "keys.toml"
    path.write_text(text.replace("{h}", hash_key("k")))
    with pytest.raises(KeyFileError) as info:
        KeyStore.from_toml(str(path))
    assert f"line {line}" in str(info.value)


def test_economics_reproduces_deepseeks_published_day():
    day = deepseek_day()
    assert abs(day.revenue / DEEPSEEK_PUBLISHED["revenue"] - 1) < 0.001
    assert day.cost == pytest.approx(DEEPSEEK_PUBLISHED["cost"])
    assert round(day.margin, 2) == pytest.approx(5.46, abs=0.01)
    assert day.revenue_per_gpu_hour == pytest.approx(12.9, abs=0.05)
