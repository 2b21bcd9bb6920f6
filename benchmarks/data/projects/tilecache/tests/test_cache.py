from tilecache import config
from tilecache.cache import TileCache, tile_for


def test_tile_for_origin():
    assert tile_for(0.0, 0.0, 1) == (1, 1, 1)


def test_entry_is_served_within_ttl():
    now = [0.0]
    cache = TileCache(clock=lambda: now[0])
    cache.put((14, 1, 1), b"png")
    now[0] = 3600.0
    assert cache.get((14, 1, 1)) == b"png"


def test_entry_expires_after_ttl():
    now = [0.0]
    cache = TileCache(clock=lambda: now[0])
    cache.put((14, 1, 1), b"png")
    now[0] = config.TILE_TTL_SECONDS + 1
    assert cache.get((14, 1, 1)) is None


def test_missing_entry():
    assert TileCache().get((3, 0, 0)) is None
