"""Runnable examples (each works on the embedded default model): python -m examples.<name>."""
