"""Reference agents built on kvmemory."""
