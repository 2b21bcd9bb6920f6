"""A region-aware cache for rendered map tiles."""
