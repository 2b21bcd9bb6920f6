"""Invoice lines and totals."""

from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal

from billing.config import INVOICE_PREFIX, VAT_RATE

CENT = Decimal("0.01")


@dataclass
class Line:
    description: str
    quantity: int
    unit_price: Decimal


@dataclass
class Invoice:
    number: int
    customer: str
    lines: list[Line] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{INVOICE_PREFIX}{self.number}"

    def net(self) -> Decimal:
        return sum((line.unit_price * line.quantity for line in self.lines), Decimal("0"))

    def vat(self) -> Decimal:
        return round(self.net() * VAT_RATE, 2)  # BUG: banker's rounding; invoices round half up

    def total(self) -> Decimal:
        return (self.net() + self.vat()).quantize(CENT, rounding=ROUND_HALF_UP)
