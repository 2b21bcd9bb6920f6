"""Process one export file and print the log the nightly job writes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ingest.pipeline import SETTINGS, aggregate, too_many_rejects  # noqa: E402

path = sys.argv[1]
clicks, rejects = aggregate(path)
total = sum(clicks.values()) + len(rejects)
print(f"INFO  reading {path} ({total} rows) into {SETTINGS['warehouse']['schema']}.{SETTINGS['warehouse']['table']}")
for (day, page), count in sorted(clicks.items()):
    print(f"INFO  {day} {page:<16} {count:>3} clicks")
for reject in rejects:
    print(f"WARN  rejected {reject}")
if too_many_rejects(len(rejects), total):
    print(f"ERROR {len(rejects)} of {total} rows rejected: above the limit, batch not loaded")
    sys.exit(3)
print(f"INFO  loaded {total - len(rejects)} rows, rejected {len(rejects)}")
