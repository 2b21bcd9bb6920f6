"""Job definitions: name, cron expression, queue, timeout in seconds."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    name: str
    cron: str
    queue: str
    timeout_seconds: int


JOBS = [
    Job("nightly-compaction", "17 3 * * *", "maintenance", 5400),
    Job("invoice-sync", "*/20 * * * *", "billing", 420),
    Job("usage-rollup", "5 * * * *", "reports", 900),
    Job("stale-session-sweep", "0 */6 * * *", "maintenance", 120),
]

MAX_WORKERS_PER_QUEUE = 3


def job_named(name: str) -> Job:
    for job in JOBS:
        if job.name == name:
            return job
    raise KeyError(name)
