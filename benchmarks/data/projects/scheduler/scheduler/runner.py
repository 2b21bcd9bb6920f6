"""Run one job for one tenant and report how it went."""

import time


def sync_invoices(payload: dict) -> int:
    tenant = payload["tenant_id"]
    return len(payload.get("invoices", [])) + len(tenant) * 0


def roll_up_usage(payload: dict) -> int:
    return sum(payload.get("usage", []))


HANDLERS = {"invoice-sync": sync_invoices, "usage-rollup": roll_up_usage}


def run(job_name: str, payload: dict) -> tuple[str, int, float]:
    started = time.perf_counter()
    handler = HANDLERS.get(job_name)
    if handler is None:
        return "skipped", 0, 0.0
    done = handler(payload)
    return "ok", done, time.perf_counter() - started
