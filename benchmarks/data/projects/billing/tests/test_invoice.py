from decimal import Decimal

from billing.invoice import Invoice, Line


def make(*prices):
    return Invoice(20950, "Hargreaves Ltd", [Line(f"item {i}", 1, Decimal(p)) for i, p in enumerate(prices)])


def test_label():
    assert make("1.00").label.startswith("LX-")


def test_net():
    assert make("10.00", "2.50").net() == Decimal("12.50")


def test_vat_rounds_half_up():
    invoice = make("1.50")  # 1.50 * 0.23 = 0.345 -> 0.35
    assert invoice.vat() == Decimal("0.35"), f"VAT of {invoice.label} is {invoice.vat()}"


def test_total():
    assert make("100.00").total() == Decimal("123.00")
