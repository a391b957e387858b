"""Every table the load tester prints keeps every number whole at any width: rendered into
80 columns (a file or a pipe) and 40 columns (a narrow terminal) it fits them, wrapping
labels and prose or splitting into parts; narrower than any part it is printed wider than the
console rather than cut. Figures with many digits make the widths tight."""
import io
import re

import pytest
from rich.console import Console
from rich.table import Table

from loadtest.compare import compare_table
from loadtest.figures import figures, grouped
from loadtest.pricing import PriceBook
from loadtest.record import RequestRecord
from loadtest.report import report_tables
from loadtest.slo import SLO
from loadtest.stats import summarize
from loadtest.tables import layout, show

NUMBER = re.compile(r"^[-+$]?\d[\d,]*(\.\d+)?(e[-+]\d+)?%?$")
BOX = re.compile("[\u2500-\u257f]")  # box-drawing characters: the table's rules


def slow_record(i: int, tenant: str) -> RequestRecord:
    """A request of huge latencies (hours), so every figure has many digits."""
    r = RequestRecord(str(i), tenant, i % 2, "w", "sse", intended=0.0, sent=0.0)
    t = 1234.567891 + i
    r.chunks = [(t, 1), (t + 98.7654321, 2), (t + 4567.891234, 1)]
    r.end = t + 500000.123456
    r.usage = {"prompt_tokens": 123456789, "completion_tokens": 4,
               "prompt_tokens_details": {"cached_tokens": 98765432}}
    r.count_source = "usage"
    return r


@pytest.fixture(scope="module")
def result() -> dict:
    recs = [slow_record(i, f"tenant-{i % 3}") for i in range(12)]
    money = (SLO.parse("ttft:5000"), PriceBook.preset("deepseek-r1"), 0.001, 98765.4321)
    return {"run": {"workload": "shared-prefix", "url": "http://127.0.0.1:8000"},
            "summary": figures(recs, *money),
            "by_priority": grouped(recs, lambda r: r.priority, *money),
            "by_tenant": grouped(recs, lambda r: r.tenant, *money),
            "client": {"loop_lag_ms": summarize([123456.789, 234567.891], 1000.0)}}


def all_tables(result: dict) -> list[Table]:
    other = {**result, "summary": figures([slow_record(99, "x")], SLO(),
                                          PriceBook.preset("seed"))}
    return [*report_tables(result), compare_table(result, other, "A = a.json   B = b.json")]


def numbers_in(table: Table) -> set[str]:
    words = set()
    for column in table.columns:
        for cell in column.cells:
            words.update(w for w in str(cell).split() if NUMBER.match(w.strip("(),;/")))
    return {w.strip("(),;/") for w in words}


def rendered_words(table: Table, width: int) -> tuple[set[str], list[str]]:
    buf = io.StringIO()
    show(Console(file=buf, width=width), table)
    text = buf.getvalue()
    assert "…" not in text
    words = {w.strip("(),;/") for w in BOX.sub(" ", text).split()}
    return words, text.splitlines()


@pytest.mark.parametrize("width", [80, 40])
def test_every_number_whole_and_every_line_fits(result, width):
    for i in range(len(all_tables(result))):
        table = all_tables(result)[i]  # a fresh table: showing one fixes its column widths
        expected = numbers_in(table)
        assert expected  # the figures really are there to be checked
        words, lines = rendered_words(table, width)
        assert expected <= words, (table.title, sorted(expected - words))
        assert max(len(line) for line in lines) <= width, table.title


def test_numbers_have_many_digits(result):
    longest = max(len(w) for t in all_tables(result) for w in numbers_in(t))
    assert longest >= 14  # "1,234,567.89"-sized and more: tight in 40 columns


def test_a_console_narrower_than_a_number_prints_it_wider_not_cut(result):
    for table in all_tables(result):
        expected = numbers_in(table)
        words, _ = rendered_words(table, 12)
        assert expected <= words


def test_wide_tables_split_into_parts_that_each_fit(result):
    latency = report_tables(result)[1]
    parts = layout(Console(file=io.StringIO(), width=40), latency)
    assert len(parts) > 1 and all(isinstance(p, Table) for p in parts)
    assert all(p.columns[0].header.plain == "metric" for p in parts)  # the label repeats
    headers = [c.header.plain for p in parts for c in p.columns[1:]]
    assert headers == ["count", "mean", "p50", "p90", "p99", "p99.9", "max"]


def test_a_table_that_fits_is_left_as_it_is(result):
    latency = report_tables(result)[1]
    assert layout(Console(file=io.StringIO(), width=400), latency) == [latency]
    assert all(c.width is None for c in latency.columns)
