"""The charts draw every bucket and every value that has data, read from the Figure's artists
and from the PNG's pixels: a bucket with data between two empty ones (a NaN gap on each side)
shows as a marker, and a distribution of one request as a visible step."""
import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from loadtest.charts import DPI, latency_figure, timeline_figure
from loadtest.record import RequestRecord

N = 20
DATA = range(0, N, 2)  # 10 buckets with requests, each between two without


def series(values: dict[int, float]) -> list:
    return [values.get(i) for i in range(N)]


@pytest.fixture
def ts() -> dict:
    """A run whose requests finish only in every other second: the medians have 10 lone
    points, none next to another (a line through them draws nothing)."""
    return {"bucket_s": 1.0, "t": [float(i) for i in range(N)],
            "finished": [1 if i in DATA else 0 for i in range(N)],
            "output_tokens": [7 if i in DATA else 0 for i in range(N)],
            "errors": [1 if i == 5 else 0 for i in range(N)],
            "in_flight": [1 if i in DATA else 0 for i in range(N)],
            "ttft_p50_ms": series({i: 100.0 + 10 * i for i in DATA}),
            "e2e_p50_ms": series({i: 2000.0 - 10 * i for i in DATA})}


def finite_points(line) -> np.ndarray:
    xy = np.asarray(line.get_xydata(), dtype=float)
    return xy[np.isfinite(xy).all(axis=1)]


def visible_marker(line) -> bool:
    return line.get_marker() not in (None, "None", "", " ") and line.get_markersize() > 0


def test_every_timeline_line_marks_each_bucket_with_data(ts):
    fig = timeline_figure(ts)
    expected = {"output tokens/s": N, "requests finished/s": N, "in flight": N,
                "TTFT p50 (ms)": len(DATA), "e2e p50 (ms)": len(DATA)}
    lines = [line for ax in fig.axes for line in ax.get_lines()]
    assert sorted(line.get_label() for line in lines) == sorted(expected)
    for line in lines:
        assert visible_marker(line), line.get_label()
        assert len(finite_points(line)) == expected[line.get_label()], line.get_label()
    ttft = next(line for line in lines if line.get_label() == "TTFT p50 (ms)")
    assert list(finite_points(ttft)[:, 0]) == [float(i) for i in DATA]


def pixel_has_colour(img: np.ndarray, x: float, y: float, rgb, radius: int = 1) -> bool:
    """Is a pixel within `radius` of display point (x, y) (origin bottom left) of colour
    `rgb`? Markers are antialiased at their rim, not at their centre."""
    row, col = img.shape[0] - 1 - round(y), round(x)
    patch = img[row - radius:row + radius + 1, col - radius:col + radius + 1, :3]
    return bool((np.abs(patch - np.asarray(rgb)).max(axis=2) < 0.08).any())


def test_timeline_png_shows_each_lone_median(ts, tmp_path):
    fig = timeline_figure(ts)
    path = tmp_path / "timeline.png"
    fig.savefig(path, dpi=DPI)  # as timeline_chart: display points are the file's pixels
    img = imread(path)
    mid = fig.axes[1]
    legend = mid.get_legend().get_window_extent()
    for line in mid.get_lines():
        rgb = to_rgb(line.get_color())
        for x, y in mid.transData.transform(finite_points(line)):
            assert not legend.contains(x, y)  # a point under the legend would prove nothing
            assert pixel_has_colour(img, x, y, rgb), (line.get_label(), x, y)
        # halfway between two lone points there is no data and nothing drawn
        (x0, y0), (x1, y1) = mid.transData.transform(finite_points(line)[:2])
        assert not pixel_has_colour(img, (x0 + x1) / 2, (y0 + y1) / 2, rgb)


def one_request() -> RequestRecord:
    r = RequestRecord("0", "t", None, "w", "sse", intended=0.0, sent=0.0)
    r.chunks, r.end, r.count_source = [(0.25, 1), (0.30, 1)], 0.5, "usage"
    return r


def test_latency_cdf_of_one_request_is_a_visible_step(tmp_path):
    fig = latency_figure([one_request()])
    path = tmp_path / "latency.png"
    fig.savefig(path, dpi=DPI)
    img = imread(path)
    for ax, value_ms in zip(fig.axes, (250.0, 50.0, 500.0)):  # TTFT, the one ITL, e2e
        (line,) = ax.get_lines()
        xy = finite_points(line)
        assert xy[:, 0] == pytest.approx([value_ms] * len(xy))
        assert (xy[:, 1].min(), xy[:, 1].max()) == (0, 1)
        # the rise from 0 to 1 at the value: its middle is drawn in the line's colour
        x, y = ax.transData.transform((value_ms, 0.5))
        assert pixel_has_colour(img, x, y, to_rgb(line.get_color()))
