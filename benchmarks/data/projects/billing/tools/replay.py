"""Replay a day of invoices through the totals and print what the export would log."""

import random
import sys
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from billing.invoice import Invoice, Line  # noqa: E402

CUSTOMERS = ["Hargreaves Ltd", "Okoro & Sons", "Vasquez Dental", "Nordlys AS", "Brightwater Café", "Kettering Mills"]

rng = random.Random(20)
for n in range(20960, 20990):
    customer = CUSTOMERS[rng.randrange(len(CUSTOMERS))]
    lines = [Line("service", rng.randint(1, 5), Decimal(rng.randint(50, 9999)) / 100) for _ in range(rng.randint(1, 3))]
    inv = Invoice(n, customer, lines)
    stamp = f"2026-11-02 01:{45 + (n - 20960) // 10:02d}:{(n * 7) % 60:02d}"
    print(f"{stamp} INFO  export {inv.label} customer={customer!r} net={inv.net()} vat={inv.vat()} total={inv.total()}")
    if n == 20977:
        print(f"{stamp} WARN  currency mismatch on {inv.label}: expected EUR, gateway answered GBP")
    if n == 20983:
        print(f"{stamp} ERROR gateway timeout on {inv.label} after 30.0 s (attempt 3); request id req-7f3a19")
print("2026-11-02 01:47:59 INFO  export finished: 30 invoices, 1 warning, 1 error")
