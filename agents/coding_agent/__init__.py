"""The reference coding agent: a LangGraph agent with sandboxed file and command tools under a KV memory cap."""
