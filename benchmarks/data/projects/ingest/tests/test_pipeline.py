import pytest

from ingest.pipeline import RejectedRow, aggregate, parse_row, too_many_rejects


def test_parse_good_row():
    eid, page, when = parse_row({"event_id": "evt-1", "timestamp": "2026-11-01T08:00:00", "page": "/"})
    assert (eid, page, when.hour) == ("evt-1", "/", 8)


def test_parse_rejects_relative_page():
    with pytest.raises(RejectedRow, match="not a path"):
        parse_row({"event_id": "evt-2", "timestamp": "2026-11-01T08:00:00", "page": "docs"})


def test_reject_limit():
    assert too_many_rejects(2, 44) is False


def test_aggregate_export():
    clicks, rejects = aggregate("data/events.csv")
    assert len(rejects) == 0, "\n".join(rejects)
