"""The API dialects the server speaks, each converted into the serving core's Turn and back.

One module per dialect: ``openai_chat`` (Chat Completions), ``openai_responses`` (the Responses API) and
``anthropic_messages`` (the Messages API). Each parses and checks its request (a bad field is a 400 that
names it), makes the Turn, and renders a Reply, or a stream of text pieces ending in a Reply, in its own
shapes. ``common`` holds what they share.
"""
