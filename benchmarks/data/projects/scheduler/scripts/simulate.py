"""Replay last night's schedule: every job for every tenant, logged as the worker logs it."""

import random
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.jobs import JOBS  # noqa: E402
from scheduler.runner import run  # noqa: E402

TENANTS = ["t-aurora", "t-basalt", "t-cinder", "t-dunmore"]
rng = random.Random(11)
run_id = 5500
for hour in range(1, 3):
    for job in JOBS:
        for tenant in TENANTS:
            run_id += 1
            payload = {"tenant_id": tenant, "invoices": list(range(rng.randint(0, 30))), "usage": [rng.randint(1, 9)]}
            if run_id == 5521:
                payload = {"tenant": tenant, "invoices": [1, 2]}  # the malformed message from the queue
            stamp = f"2026-11-03 0{hour}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
            try:
                status, done, _ = run(job.name, payload)
            except Exception:
                print(f"{stamp} ERROR run-{run_id} {job.name} tenant={tenant} queue={job.queue} crashed:")
                print(traceback.format_exc().rstrip().replace(str(Path.cwd()), "."))
                continue
            print(f"{stamp} INFO  run-{run_id} {job.name:<20} tenant={tenant:<9} {status:<7} items={done}")
