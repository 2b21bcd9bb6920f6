"""Cache configuration (reviewed by the maps platform team; see decision record ADR-0042)."""

CACHE_ROOT = "/var/cache/tilecache/z-order"
TILE_TTL_SECONDS = 86400
MAX_ENTRIES = 250_000
UPSTREAM_TIMEOUT_SECONDS = 2.5
EVICTION = "lru"
MIN_ZOOM, MAX_ZOOM = 3, 17
STATS_PREFIX = "maps.tilecache.prod"
