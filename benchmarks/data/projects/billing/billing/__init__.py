"""Invoices: totals, VAT and the ledger export."""
