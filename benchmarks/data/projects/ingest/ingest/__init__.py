"""Click-stream ingestion: parse, validate, aggregate."""
