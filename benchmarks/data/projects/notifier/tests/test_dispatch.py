from notifier.dispatch import PermanentFailure, deliver
from notifier.templates import render


def test_render_invoice():
    assert render("invoice_ready", {"invoice": "INV-1", "total": "1.00 EUR"}) == "Your invoice INV-1 is ready. Total: 1.00 EUR."


def test_timeouts_are_retried():
    calls = []

    def send(to, body):
        calls.append(to)
        if len(calls) < 3:
            raise TimeoutError

    assert deliver({"id": "m1", "kind": "weekly_digest", "to": "x", "fields": {"count": 1}}, send, print) == "sent"
    assert len(calls) == 3


def test_refused_recipient_fails_without_retry():
    def send(to, body):
        raise PermanentFailure("550")

    assert deliver({"id": "m2", "kind": "weekly_digest", "to": "x", "fields": {"count": 1}}, send, print) == "failed"


def test_missing_field_is_a_failure_not_a_crash():
    message = {"id": "m3", "kind": "invoice_ready", "to": "x", "fields": {"invoice": "INV-2"}}
    assert deliver(message, lambda to, body: None, print) == "failed"
