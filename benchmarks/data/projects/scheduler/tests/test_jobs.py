import pytest

from scheduler.jobs import JOBS, job_named
from scheduler.runner import run


def test_job_names_unique():
    assert len({j.name for j in JOBS}) == len(JOBS)


def test_job_named_unknown():
    with pytest.raises(KeyError):
        job_named("missing")


def test_invoice_sync_counts_invoices():
    assert run("invoice-sync", {"tenant_id": "t-x", "invoices": [1, 2, 3]})[:2] == ("ok", 3)


def test_invoice_sync_without_tenant_is_skipped():
    status, done, _ = run("invoice-sync", {"tenant": "t-x", "invoices": [1]})
    assert status == "skipped", f"a message without tenant_id must be skipped, got {status}"
