"""Warm the cache for every region's city centres and print the log."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tilecache import config  # noqa: E402
from tilecache.cache import TileCache, tile_for  # noqa: E402
from tilecache.regions import UPSTREAMS, WARM  # noqa: E402

DOWN = {"ap"}


def main() -> None:
    cache, now = TileCache(clock=lambda: 1000.0), 1000.0
    for region, cities in WARM.items():
        for city, lat, lon in cities:
            key = tile_for(lat, lon, 14)
            if region in DOWN:
                print(
                    f"[{region}] {city}: TimeoutError: upstream {UPSTREAMS[region]} did not answer "
                    f"in {config.UPSTREAM_TIMEOUT_SECONDS} s"
                )
                continue
            cache.put(key, b"png")
            print(f"[{region}] {city}: warmed tile z{key[0]}/{key[1]}/{key[2]}")
    cache.clock = lambda: now + 120.0
    warmed = list(cache.entries)
    hits = sum(cache.get(k) is not None for k in warmed)
    print(f"two minutes later: {hits} of {len(warmed)} warmed tiles still cached")


if __name__ == "__main__":
    main()
