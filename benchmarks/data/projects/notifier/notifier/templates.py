"""Message templates by kind; each takes the message's fields."""

TEMPLATES = {
    "invoice_ready": "Your invoice {invoice} is ready. Total: {total}.",
    "password_reset": "Use this link to reset your password: {link}",
    "build_failed": "Build {build} of {project} failed at step {step}.",
    "weekly_digest": "You have {count} new updates this week.",
}


def render(kind: str, fields: dict) -> str:
    template = TEMPLATES[kind]
    return template.format(**fields)
