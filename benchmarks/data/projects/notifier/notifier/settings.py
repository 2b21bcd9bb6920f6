"""Delivery settings. Changing them needs a change request in the NTF project."""

SMTP_RELAY = "relay-7.mail.internal"
SMTP_PORT = 2525
SENDER = "no-reply@platform.example"
MAX_RETRIES = 4
RETRY_DELAY_SECONDS = 45
RATE_LIMIT_PER_MINUTE = 37
TEMPLATE_DIR = "/srv/notifier/templates/v3"
CHAT_WEBHOOK = "https://chat.example/hooks/T0931/B77Q"
DEFAULT_LOCALE = "pt-BR"
