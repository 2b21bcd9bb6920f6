"""Parse the CSV export, reject malformed rows, aggregate clicks per page and day."""

import configparser
import csv
from collections import Counter
from datetime import datetime
from pathlib import Path

SETTINGS = configparser.ConfigParser()
SETTINGS.read(Path(__file__).with_name("settings.ini"))
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S"


class RejectedRow(ValueError):
    pass


def parse_row(row: dict) -> tuple[str, str, datetime]:
    try:
        when = datetime.strptime(row["timestamp"], TIMESTAMP_FORMAT)
    except ValueError as err:
        raise RejectedRow(f"{row['event_id']}: bad timestamp {row['timestamp']!r}") from err
    if not row["page"].startswith("/"):
        raise RejectedRow(f"{row['event_id']}: page {row['page']!r} is not a path")
    return row["event_id"], row["page"], when


def aggregate(path: str) -> tuple[Counter, list[str]]:
    clicks, rejects = Counter(), []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                _, page, when = parse_row(row)
            except RejectedRow as err:
                rejects.append(str(err))
                continue
            clicks[(when.date().isoformat(), page)] += 1
    return clicks, rejects


def too_many_rejects(rejects: int, total: int) -> bool:
    limit = SETTINGS.getint("batch", "max_rejects_percent")
    return rejects * 100 > limit * total
