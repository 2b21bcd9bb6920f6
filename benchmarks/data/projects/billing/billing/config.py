"""Billing settings. The ledger export and the payment gateway read these at start-up."""

from decimal import Decimal

VAT_RATE = Decimal("0.23")
INVOICE_PREFIX = "LX-"
PAYMENT_GATEWAY_URL = "https://pay.internal:8443/v2"
GATEWAY_RETRY_LIMIT = 9
LEDGER_BUCKET = "s3://acme-ledger-eu-7"
EXPORT_CRON = "45 1 * * *"
LATE_FEE_PERCENT = Decimal("2.75")
