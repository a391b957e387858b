"""The day-shaped arrival profile: arrival counts per stretch of the compressed day follow the
curve (within Poisson bounds, fixed seed), the curve interpolates and wraps midnight, curve
files and flags are checked with clear errors, and the command line builds the profile."""
from __future__ import annotations

import itertools
import math

import pytest

from loadtest.cli import build_parser, settings_from
from loadtest.day_profile import CurveError, DayProfile, read_curve


def times_until(profile: DayProfile, end: float, seed: int) -> list[float]:
    return list(itertools.takewhile(lambda t: t < end, profile.arrival_times(seed)))


@pytest.mark.parametrize("seed", [0, 1])
def test_counts_per_segment_follow_the_curve(seed):
    profile = DayProfile(rate_min=5.0, rate_max=60.0, day_seconds=240.0)
    times = times_until(profile, 240.0, seed)
    segments = 24  # one compressed hour each
    width = 240.0 / segments
    counts = [0] * segments
    for t in times:
        counts[int(t // width)] += 1
    for i, n in enumerate(counts):
        expected = profile.expected(i * width, (i + 1) * width)
        # a Poisson count: beyond 4.5 standard deviations about once in 150,000 segments
        assert abs(n - expected) <= 4.5 * math.sqrt(expected) + 1, (i, n, expected)
    # the shape itself: the afternoon peak well above the night trough
    assert counts[14] > 3 * counts[4]
    assert len(times) == pytest.approx(profile.expected(0, 240.0),
                                       abs=4.5 * math.sqrt(profile.expected(0, 240.0)))


def test_the_schedule_is_fixed_by_the_seed():
    profile = DayProfile(1.0, 20.0, 60.0)
    assert times_until(profile, 60, 3) == times_until(profile, 60, 3)
    assert times_until(profile, 60, 3) != times_until(profile, 60, 4)


def test_the_curve_interpolates_and_wraps_midnight():
    p = DayProfile(10.0, 110.0, 24.0, ((6.0, 0.0), (18.0, 1.0)))
    assert p.fraction(12.0) == pytest.approx(0.5)
    assert p.fraction(0.0) == pytest.approx(0.5)  # halfway from 18:00 (1) to 06:00 (0)
    assert p.fraction(21.0) == pytest.approx(0.75)
    assert p.fraction(30.0) == p.fraction(6.0) == 0.0  # a second day repeats the first
    assert p.rate(12.0) == pytest.approx(60.0)  # 24 s a day: 12 s is noon
    flat = DayProfile(2.0, 4.0, 100.0, ((12.0, 0.25),))
    assert {flat.fraction(h) for h in (0.0, 7.5, 23.9)} == {0.25}


def test_a_curve_file_is_read_and_bad_ones_refused(tmp_path):
    good = tmp_path / "curve.txt"
    good.write_text("# hour fraction\n0 0.2\n12,1.0  # noon\n\n24 0.2\n")
    assert read_curve(str(good)) == ((0.0, 0.2), (12.0, 1.0), (24.0, 0.2))
    for text, message in (("0 0.2\nnoon 1\n", ":2: expected"), ("25 0.5\n", "outside 0..24"),
                          ("3 1.5\n", "outside 0..1"), ("1 0.1\n1 0.2\n", "twice"),
                          ("# nothing\n", "at least one")):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(CurveError, match=message):
            read_curve(str(bad))
    with pytest.raises(CurveError, match="rate-min"):
        DayProfile(5.0, 1.0)
    with pytest.raises(CurveError, match="day-seconds"):
        DayProfile(0.0, 1.0, 0.0)


def test_the_command_line_builds_the_profile(tmp_path):
    curve = tmp_path / "curve.txt"
    curve.write_text("0 0.25\n14 1\n")
    base = ["--url", "http://127.0.0.1:1", "--duration", "240"]
    args = build_parser().parse_args(base + [
        "--arrival-profile", "day", "--day-seconds", "120", "--rate-min", "2",
        "--rate-max", "8", "--day-curve", str(curve)])
    shape = settings_from(args).shape
    assert shape.rate == 8.0 and shape.day is not None
    assert shape.day.points == ((0.0, 0.25), (14.0, 1.0)) and shape.day.day_seconds == 120
    assert shape.as_dict()["day"]["points"] == [[0.0, 0.25], [14.0, 1.0]]
    for extra, message in ((["--arrival-profile", "day"], "needs --rate-max"),
                           (["--arrival-profile", "day", "--rate-max", "4", "--rate", "2"],
                            "not --rate"),
                           (["--rate", "2", "--rate-max", "4"], "need --arrival-profile"),
                           (["--arrival-profile", "day", "--rate-max", "4", "--day-curve",
                             str(tmp_path / "missing")], "--day-curve")):
        with pytest.raises(SystemExit, match=message):
            settings_from(build_parser().parse_args(base + extra))
