"""The nightly export: one CSV row per invoice."""

import csv
import io

from billing.invoice import Invoice


def export_rows(invoices: list[Invoice]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["invoice", "customer", "net", "vat", "total"])
    for inv in invoices:
        writer.writerow([inv.label, inv.customer, inv.net(), inv.vat(), inv.total()])
    return out.getvalue()
