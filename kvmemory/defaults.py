"""Defaults shared by every front end (the chat model, the server, both command lines), in a module that
imports nothing, so a command's ``--help`` can show them without loading the engine."""

DEFAULT_MAX_SLOTS = 2048  # the cap per session (slots per KV head) where no policy or --max-slots names one
