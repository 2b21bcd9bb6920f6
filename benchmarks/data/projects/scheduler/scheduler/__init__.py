"""Cron-scheduled tenant jobs."""
