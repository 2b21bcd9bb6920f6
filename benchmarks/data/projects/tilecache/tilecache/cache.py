"""The tile cache: entries expire after the configured TTL."""

import math
import time

from tilecache import config


def tile_for(lat: float, lon: float, zoom: int) -> tuple[int, int, int]:
    """Web-Mercator tile (zoom, x, y) that holds a point."""
    n = 2**zoom
    x = int((lon + 180.0) / 360.0 * n)
    y = int((1.0 - math.asinh(math.tan(math.radians(lat))) / math.pi) / 2.0 * n)
    return zoom, x, y


class TileCache:
    def __init__(self, clock=time.time):
        self.clock = clock
        self.entries = {}

    def put(self, key, data: bytes) -> None:
        self.entries[key] = (data, self.clock())

    def get(self, key):
        if key not in self.entries:
            return None
        data, stored_at = self.entries[key]
        if self.clock() - stored_at > config.TILE_TTL_SECONDS / 1000:  # BUG: the TTL is already in seconds
            del self.entries[key]
            return None
        return data
