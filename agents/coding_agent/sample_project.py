"""A small, real Python project with planted facts and a real bug, for the demo, benchmarks and tests.

``create_sample_project(path)`` writes it; its tests fail with genuine tracebacks until the bug is fixed.
The facts (a port, a timeout, a codename, an owner) live in files the agent must read, so a memory
that lost them shows it when the agent is asked later.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

TASK = (
    "Task: the inventory project's restock test fails. Find the bug, fix it and make every test pass. "
    "Later I will ask you about the settings and the failing test, so note them as you go."
)

FACTS = {
    "database_port": ("What is the database port in settings.py?", "5433"),
    "api_timeout": ("What is API_TIMEOUT_SECONDS in settings.py?", "17"),
    "codename": ("What is the release codename in settings.py?", "blue-heron"),
    "owner": ("Who is the maintainer named in the README?", "Ilse Marchetti"),
    "failing_sku": ("Which SKU makes test_restock fail?", "WX-4471"),
}

FILES = {
    "README.md": """
        # inventory

        Stock keeping for a small warehouse. Maintainer: Ilse Marchetti (on call Tuesdays).

        Run the tests with `python -m pytest -q`. Pricing rules live in `inventory/pricing.py`,
        warehouse settings in `inventory/settings.py`.
        """,
    "inventory/__init__.py": '''
        """Stock keeping for a small warehouse."""
        ''',
    "inventory/settings.py": '''
        """Warehouse settings. Change with care: the scanner firmware reads these values."""

        DATABASE_HOST = "db.internal"
        DATABASE_PORT = 5433
        API_TIMEOUT_SECONDS = 17
        RELEASE_CODENAME = "blue-heron"
        LOW_STOCK_THRESHOLD = 12
        CURRENCY = "EUR"
        ''',
    "inventory/models.py": '''
        """Items and the stock ledger."""

        from dataclasses import dataclass, field


        @dataclass
        class Item:
            sku: str
            name: str
            unit_price_cents: int
            quantity: int = 0
            tags: list[str] = field(default_factory=list)

            def value_cents(self) -> int:
                return self.unit_price_cents * self.quantity


        class Ledger:
            """All items by SKU, with a history of every change."""

            def __init__(self):
                self.items: dict[str, Item] = {}
                self.history: list[tuple[str, str, int]] = []

            def add(self, item: Item) -> None:
                if item.sku in self.items:
                    raise ValueError(f"duplicate SKU {item.sku}")
                self.items[item.sku] = item
                self.history.append(("add", item.sku, item.quantity))

            def restock(self, sku: str, amount: int) -> Item:
                item = self.items[sku]
                if amount <= 0:
                    raise ValueError("restock amount must be positive")
                item.quantity = amount  # BUG: should add to the existing quantity
                self.history.append(("restock", sku, amount))
                return item

            def remove(self, sku: str, amount: int) -> Item:
                item = self.items[sku]
                if amount > item.quantity:
                    raise ValueError(f"only {item.quantity} of {sku} in stock")
                item.quantity -= amount
                self.history.append(("remove", sku, amount))
                return item

            def low_stock(self, threshold: int) -> list[Item]:
                return sorted((i for i in self.items.values() if i.quantity < threshold), key=lambda i: i.sku)
        ''',
    "inventory/pricing.py": '''
        """Pricing rules: bulk discounts and tax."""

        from inventory.models import Item

        BULK_DISCOUNTS = [(100, 0.15), (50, 0.10), (20, 0.05)]
        VAT_RATE = 0.21


        def discount_rate(quantity: int) -> float:
            for threshold, rate in BULK_DISCOUNTS:
                if quantity >= threshold:
                    return rate
            return 0.0


        def order_total_cents(item: Item, quantity: int, with_vat: bool = True) -> int:
            net = item.unit_price_cents * quantity * (1 - discount_rate(quantity))
            return round(net * (1 + VAT_RATE) if with_vat else net)
        ''',
    "inventory/report.py": '''
        """Plain-text stock reports."""

        from inventory.models import Ledger
        from inventory.settings import CURRENCY, LOW_STOCK_THRESHOLD


        def stock_report(ledger: Ledger) -> str:
            lines = [f"{'SKU':<10}{'name':<24}{'qty':>6}{'value':>12}"]
            for item in sorted(ledger.items.values(), key=lambda i: i.sku):
                value = item.value_cents() / 100
                lines.append(f"{item.sku:<10}{item.name:<24}{item.quantity:>6}{value:>9.2f} {CURRENCY}")
            low = ledger.low_stock(LOW_STOCK_THRESHOLD)
            if low:
                lines.append("LOW STOCK: " + ", ".join(i.sku for i in low))
            return "\\n".join(lines)
        ''',
    "tests/test_ledger.py": """
        import pytest

        from inventory.models import Item, Ledger


        @pytest.fixture
        def ledger():
            ledger = Ledger()
            ledger.add(Item("WX-4471", "widget, large", 1250, quantity=8))
            ledger.add(Item("GZ-1002", "gizmo", 399, quantity=40))
            ledger.add(Item("BT-0090", "bolt pack", 75, quantity=300))
            return ledger


        def test_restock(ledger):
            item = ledger.restock("WX-4471", 10)
            assert item.quantity == 18, f"restocking WX-4471 by 10 from 8 gave {item.quantity}"


        def test_remove(ledger):
            assert ledger.remove("GZ-1002", 15).quantity == 25


        def test_remove_too_many(ledger):
            with pytest.raises(ValueError, match="only 8"):
                ledger.remove("WX-4471", 9)


        def test_low_stock(ledger):
            assert [i.sku for i in ledger.low_stock(12)] == ["WX-4471"]


        def test_history_after_restock(ledger):
            ledger.restock("BT-0090", 50)
            assert ledger.items["BT-0090"].quantity == 350
        """,
    "tests/test_pricing.py": """
        from inventory.models import Item
        from inventory.pricing import discount_rate, order_total_cents


        def test_discount_tiers():
            assert [discount_rate(q) for q in (5, 20, 50, 100)] == [0.0, 0.05, 0.10, 0.15]


        def test_order_total_with_vat():
            item = Item("GZ-1002", "gizmo", 399)
            assert order_total_cents(item, 20) == round(399 * 20 * 0.95 * 1.21)


        def test_order_total_without_vat():
            assert order_total_cents(Item("BT-0090", "bolt pack", 75), 100, with_vat=False) == 6375
        """,
    "tests/test_report.py": """
        from inventory.models import Item, Ledger
        from inventory.report import stock_report


        def test_report_lists_low_stock():
            ledger = Ledger()
            ledger.add(Item("WX-4471", "widget, large", 1250, quantity=3))
            report = stock_report(ledger)
            assert "LOW STOCK: WX-4471" in report
            assert "EUR" in report
        """,
    "conftest.py": """
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))
        """,
}


def catalog_module(items: int = 120) -> str:
    """A long, deterministic catalogue module (the kind of file read that fills an agent's context)."""
    kinds = ["widget", "gizmo", "bolt pack", "hinge", "bracket", "gasket", "spring", "valve", "washer", "rivet"]
    sizes = ["small", "medium", "large", "x-large"]
    lines = ['"""The product catalogue: SKU, name, unit price in cents, reorder quantity."""', "", "CATALOG = ["]
    for i in range(items):
        sku = f"{'ABCDEFGHJK'[i % 10]}{'MNPRSTVWXZ'[(i * 7) % 10]}-{1000 + (i * 37) % 9000:04d}"
        lines.append(
            f'    ("{sku}", "{kinds[i % 10]}, {sizes[(i // 10) % 4]}", {99 + (i * 53) % 4900}, {5 + (i * 11) % 60}),'
        )
    lines += [
        "]",
        "",
        "",
        "def by_sku(sku: str):",
        "    for entry in CATALOG:",
        "        if entry[0] == sku:",
        "            return entry",
        "    raise KeyError(sku)",
        "",
    ]
    return "\n".join(lines)


def create_sample_project(path: str | Path) -> Path:
    """Write the sample project under ``path`` and return it."""
    root = Path(path)
    for name, text in FILES.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(text).lstrip())
    (root / "inventory" / "catalog.py").write_text(catalog_module())
    return root
