"""Sends outbox messages through SMTP or the chat webhook, retrying transient failures."""

from notifier import settings
from notifier.templates import TEMPLATES, render


class PermanentFailure(Exception):
    pass


def deliver(message: dict, send, log) -> str:
    """Send one message; return its final status: 'sent', 'failed' or 'skipped'."""
    kind = message["kind"]
    body = render(kind, message["fields"])
    for attempt in range(1, settings.MAX_RETRIES + 1):
        try:
            send(message["to"], body)
            log(f"{message['id']} sent on attempt {attempt}")
            return "sent"
        except PermanentFailure as err:
            log(f"{message['id']} failed permanently: {err}")
            return "failed"
        except TimeoutError:
            log(f"{message['id']} timed out on attempt {attempt}; retrying in {settings.RETRY_DELAY_SECONDS} s")
    log(f"{message['id']} gave up after {settings.MAX_RETRIES} attempts")
    return "failed"


def known_kind(kind: str) -> bool:
    return kind in TEMPLATES
