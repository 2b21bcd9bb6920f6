from decimal import Decimal

from billing.invoice import Invoice, Line
from billing.ledger import export_rows


def test_export_header_and_rows():
    rows = export_rows([Invoice(20951, "Okoro & Sons", [Line("audit", 2, Decimal("40.00"))])]).splitlines()
    assert rows[0] == "invoice,customer,net,vat,total"
    assert rows[1].startswith("LX-20951,Okoro & Sons,80.00")
