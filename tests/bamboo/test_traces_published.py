"""Published traces as they are (lightning_bamboo.simulate.published): each quirk on a synthetic trace, the
one
warning that says what was done, and the lines that are still refused."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from lightning_bamboo.simulate import TraceFormatError, TraceQuirksWarning, parse_trace
from tests.process import REPO

TRACES = REPO / "data" / "spot-traces"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def quirks(path: Path):  # type: ignore[no-untyped-def]
    """The trace and the warnings parsing it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = parse_trace(path)
    return trace, [str(w.message) for w in caught if issubclass(w.category, TraceQuirksWarning)]


def events(trace) -> list[tuple[float, str, str]]:  # type: ignore[no-untyped-def]
    return [(e.t_s, e.kind, e.node) for e in trace.events]


def test_the_published_aws_traces_need_no_repair() -> None:
    for name in ("aws-p3-trace.csv", "aws-g4dn-trace.csv"):
        trace, caught = quirks(TRACES / name)
        assert caught == [] and not trace.repairs and trace.repairs.segments == 1


def test_repeated_timestamps_in_a_count_trace_the_last_sample_wins(tmp_path: Path) -> None:
    """Two samples at 10:00:30 (3, then 1): the count goes from 2 to 1 there, never through 3."""
    path = write(tmp_path, "2019-05-01, 10:00:00, 2\n2019-05-01, 10:00:30, 3\n2019-05-01, 10:00:30, 1\n"
                           "2019-05-01, 10:01:00, 2\n")
    trace, caught = quirks(path)
    assert events(trace) == [
        (0.0, "add", "gce-1"), (0.0, "add", "gce-2"), (30.0, "remove", "gce-2"), (60.0, "add", "gce-3"),
    ]
    assert trace.repairs.superseded == (2,)
    assert caught == [f"{path}: dropped 1 count samples superseded by a later one at the same time (lines 2) "
                      "(policy: docs/bamboo-replay.md, Traces as published)"]


def test_a_backwards_jump_starts_a_segment_replayed_after_the_previous_one(tmp_path: Path) -> None:
    """The collection restarts at 10:00:30 after reaching 10:01:30 (and reports other counts): the second
    segment is shifted by +60 s to start at 90 s, where the first ended."""
    path = write(tmp_path, "2019-05-01, 10:00:00, 2\n2019-05-01, 10:01:00, 1\n2019-05-01, 10:01:30, 2\n"
                           "2019-05-01, 10:00:30, 3\n2019-05-01, 10:01:00, 2\n")
    trace, caught = quirks(path)
    assert events(trace) == [
        (0.0, "add", "gce-1"), (0.0, "add", "gce-2"), (60.0, "remove", "gce-2"), (90.0, "add", "gce-3"),
        (90.0, "add", "gce-4"), (120.0, "remove", "gce-4"),
    ]
    assert trace.duration_s == 120.0
    assert (trace.repairs.segments, trace.repairs.jumps) == (2, (4,))
    assert len(caught) == 1
    assert "time went back 1 times (lines 4): replayed as 2 segments one after another" in caught[0]
    # the first segment's last sample (line 3, 10:01:30) is superseded by the second's first at the same time
    assert "dropped 1 count samples superseded by a later one at the same time (lines 3)" in caught[0]


def test_an_overlapping_interval_of_exact_repeats_is_dropped(tmp_path: Path) -> None:
    """A collection that re-sent 10:00:30-10:01:00 unchanged: the repeats go, no segment is needed."""
    rows = ["2019-05-01, 10:00:00, 2", "2019-05-01, 10:00:30, 1", "2019-05-01, 10:01:00, 3",
            "2019-05-01, 10:00:30, 1", "2019-05-01,10:01:00,  3", "2019-05-01, 10:01:30, 2"]
    path = write(tmp_path, "\n".join(rows) + "\n")
    trace, caught = quirks(path)
    assert trace.repairs.duplicates == (4, 5) and trace.repairs.segments == 1
    assert trace.duration_s == 90.0 and trace.nodes_at(60.0) == 3 and trace.nodes_at(90.0) == 2
    assert caught == [f"{path}: dropped 2 exact repeated rows (lines 4, 5) "
                      "(policy: docs/bamboo-replay.md, Traces as published)"]


def test_exact_repeated_aws_rows_are_dropped_not_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "0,add,a\n0,add,b\n0,add,a\n5000,remove,b\n5000,remove,b\n9000,add,c\n")
    trace, caught = quirks(path)
    assert events(trace) == [(0.0, "add", "a"), (0.0, "add", "b"), (5.0, "remove", "b"), (9.0, "add", "c")]
    assert trace.repairs.duplicates == (3, 5) and len(caught) == 1


def test_a_gap_in_a_count_trace_holds_the_count_and_is_reported(tmp_path: Path) -> None:
    """Samples every 30 s, then nothing for 3 hours: the count before the gap holds through it."""
    rows = ["2019-05-01, 10:00:00, 4", "2019-05-01, 10:00:30, 3", "2019-05-01, 10:01:00, 3",
            "2019-05-01, 13:01:00, 1", "2019-05-01, 13:01:30, 2"]
    path = write(tmp_path, "\n".join(rows) + "\n")
    trace, caught = quirks(path)
    assert trace.repairs.gaps == ((4, 10800.0),)
    assert trace.nodes_at(5000.0) == 3 and trace.nodes_at(10860.0) == 1
    assert trace.mean_nodes() == pytest.approx((4 * 30 + 3 * 10830 + 1 * 30) / 10890)
    assert caught == [f"{path}: 1 sampling gaps longer than 10x the median interval (lines 4; longest "
                      "10800 s): the count before each holds through it (policy: docs/bamboo-replay.md, "
                      "Traces as published)"]


def test_a_row_out_of_order_inside_a_segment_starts_a_segment_of_its_own(tmp_path: Path) -> None:
    """The policy does not tell a late row from a restarted collection: ``10000,add,c`` after 20 s starts a
    second segment, shifted by +10 s to 20 s (the trace gets 10 s longer)."""
    path = write(tmp_path, "0,add,a\n0,add,b\n20000,remove,b\n10000,add,c\n30000,remove,a\n")
    trace, caught = quirks(path)
    assert events(trace) == [
        (0.0, "add", "a"), (0.0, "add", "b"), (20.0, "remove", "b"), (20.0, "add", "c"),
        (40.0, "remove", "a"),
    ]
    assert trace.repairs.jumps == (4,) and trace.duration_s == 40.0 and len(caught) == 1


def test_every_quirk_at_once_warns_once_with_every_count(tmp_path: Path) -> None:
    rows = ["2019-05-01, 10:00:00, 4", "2019-05-01, 10:00:00, 4", "2019-05-01, 10:00:30, 3",
            "2019-05-01, 10:00:30, 2", "2019-05-01, 10:01:00, 3", "2019-05-01, 10:00:40, 1",
            "2019-05-01, 10:01:10, 2", "2019-05-01, 12:01:10, 3", "2019-05-01, 12:01:40, 3"]
    path = write(tmp_path, "\n".join(rows) + "\n")
    trace, caught = quirks(path)
    assert len(caught) == 1
    message = caught[0]
    assert "time went back 1 times (lines 6): replayed as 2 segments" in message
    assert "dropped 1 exact repeated rows (lines 2)" in message
    assert "dropped 2 count samples superseded by a later one at the same time (lines 3, 5)" in message
    assert "1 sampling gaps longer than 10x the median interval (lines 8; longest 7200 s)" in message
    assert trace.nodes_at(0.0) == 4 and trace.nodes_at(30.0) == 2 and trace.nodes_at(60.0) == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # a malformed line inside a file with quirks is still refused, with its line
        ("2019-05-01, 10:00:00, 3\n2019-05-01, 09:00:00, 2\n2019-05-01, 10:00:30, -1\n",
         ":3: expected 'YYYY-MM-DD, HH:MM:SS, count' (GCE count sample), got '2019-05-01, 10:00:30, -1'"),
        ("0,add,a\n0,add,a\n7,add\n", ":3: expected 'time_ms,add|remove,node' (AWS trace line), got '7,add'"),
        ("2019-05-01, 10:00:00, 3\n2019-13-01, 10:00:30, 1\n", ":2: expected a valid date and time"),
        # segments that do not fit together: the second removes a node the first already removed
        ("0,add,a\n0,add,b\n9000,remove,b\n5000,remove,b\n",
         ":4: expected a remove of an alive node (b is not alive once the segments are joined), "
         "got '5000,remove,b'"),
    ],
)
def test_malformed_files_are_still_refused_with_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceQuirksWarning)
        with pytest.raises(TraceFormatError, match=re.escape(f"{path}{message}")):
            parse_trace(path)
