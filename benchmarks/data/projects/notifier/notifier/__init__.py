"""Outbox delivery for platform notifications."""
