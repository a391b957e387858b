"""Rich tables whose numbers are never cut, on a terminal of any width or in a file.

rich fits a table wider than the console by shrinking columns and cutting cells with an
ellipsis ("1,651.…"), and a console writing to a file or a pipe is 80 columns wide. So every
table the load tester prints goes through `show`, which lays it out itself. A column is one of
  label  a name (metric, tenant, figure): wraps, inside a long word too (at most down to
         LABEL_MIN columns);
  prose  text with figures in it (the headline's values): wraps between words only, so it is
         at least as wide as its longest word (a number is one word);
  number never wraps: at least as wide as its longest cell.
The table is shown
  1. at its natural width when that fits;
  2. else with every column at least its minimum, the room left shared out fairly (the
     columns wanting least get all they want first);
  3. else, for a table of more than two columns, in parts one below the other, each the first
     (label) column and a run of the next columns, as even as the parts allow;
  4. else (a part still too wide) at its minimum width, wider than the console: a terminal
     wraps the long lines, nothing is cut.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

WIDE = 100_000  # a console width no table reaches: what a table measures when unconstrained
LABEL_MIN = 10  # a label column folds its words down to this width, no further


def new_table(title: str | None, headers: Sequence[str], labels: int = 1, prose: int = 0,
              show_header: bool = True) -> Table:
    """The first `labels` columns are labels, the next `prose` prose, the rest numbers."""
    t = Table(title=title, show_header=show_header)
    for i, header in enumerate(headers):
        if i < labels:
            t.add_column(Text(header), overflow="fold")
        elif i < labels + prose:
            t.add_column(Text(header), overflow="ellipsis")
        else:
            t.add_column(Text(header), justify="right", no_wrap=True)
    return t


def add_row(table: Table, cells: Iterable[str]) -> None:
    # Text, not markup: a "[...]" in a tenant name or a value is printed as it is
    table.add_row(*(Text(c) for c in cells))


def show(console: Console, table: Table) -> None:
    for part in layout(console, table):
        console.print(part, crop=False)


def layout(console: Console, table: Table) -> list[RenderableType]:
    """What `show` prints for `table` on `console` (the steps in the module docstring)."""
    width = console.width
    low, high, extra = bounds(console, table)
    if sum(high) + extra <= width:
        return [table]
    if sum(low) + extra <= width:
        _fix_widths(table, _share(low, high, width - extra))
        return [table]
    if len(table.columns) > 2:
        return [part for t in by_columns(console, table) for part in layout(console, t)]
    _fix_widths(table, low)
    return [_Wide(table, sum(low) + extra)]


def bounds(console: Console, table: Table) -> tuple[list[int], list[int], int]:
    """Each column's narrowest and natural content width, and what borders and padding add."""
    low = [_min_width(c) for c in table.columns]
    high = [max(lo, _line_width(c)) for lo, c in zip(low, table.columns)]
    natural = Measurement.get(console, console.options.update_width(WIDE), table).maximum
    return low, high, natural - sum(high)


def _fits(console: Console, table: Table) -> bool:
    low, _, extra = bounds(console, table)
    return sum(low) + extra <= console.width


def by_columns(console: Console, table: Table) -> list[Table]:
    """The table in parts that each fit the console at their narrowest: the label column
    with a run of the next columns, as many parts as a greedy fill needs, as even as fit."""
    rest = list(range(1, len(table.columns)))
    greedy: list[list[int]] = [[]]
    for i in rest:
        if greedy[-1] and not _fits(console, _part(table, [0, *greedy[-1], i], None)):
            greedy.append([])
        greedy[-1].append(i)
    k = len(greedy)
    even = [rest[j * len(rest) // k:(j + 1) * len(rest) // k] for j in range(k)]
    runs = even if all(_fits(console, _part(table, [0, *r], None)) for r in even) else greedy
    more = f"{table.title} (continued)" if table.title else None
    return [_part(table, [0, *r], table.title if j == 0 else more) for j, r in enumerate(runs)]


def _part(table: Table, indices: list[int], title) -> Table:
    """A new table of the columns at `indices`, every row."""
    t = Table(title=title, show_header=table.show_header)
    for i in indices:
        c = table.columns[i]
        t.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, overflow=c.overflow)
    for row in zip(*(list(table.columns[i].cells) for i in indices)):
        t.add_row(*row)
    return t


def _plain(cell) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _texts(column: Column) -> list[str]:
    return [_plain(column.header), *(_plain(c) for c in column.cells)]


def _line_width(column: Column) -> int:
    return max((cell_len(line) for s in _texts(column) for line in s.splitlines()), default=1)


def _min_width(column: Column) -> int:
    """The narrowest the column can be: a number's whole cell, prose's longest word."""
    if column.no_wrap:
        return _line_width(column)
    longest = max((cell_len(w) for s in _texts(column) for w in s.split()), default=1)
    return min(longest, LABEL_MIN) if column.overflow == "fold" else longest


def _share(low: list[int], high: list[int], room: int) -> list[int]:
    """Widths from `low` up to `high` within `room`: fair shares of what is spare, the columns
    wanting least served first (a short key column is not wrapped to widen a long one)."""
    widths, spare = list(low), room - sum(low)
    order = sorted(range(len(low)), key=lambda i: high[i] - low[i])
    for k, i in enumerate(order):
        give = min(high[i] - low[i], spare // (len(order) - k))
        widths[i] += give
        spare -= give
    return widths


def _fix_widths(table: Table, widths: list[int]) -> None:
    for column, w in zip(table.columns, widths):
        column.width = w


class _Wide:
    """A renderable laid out `width` columns wide whatever the console's width; printed
    with crop=False, so its lines are longer than the console's, never cut."""

    def __init__(self, renderable: RenderableType, width: int):
        self.renderable, self.width = renderable, width

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from console.render(self.renderable, options.update_width(self.width))
