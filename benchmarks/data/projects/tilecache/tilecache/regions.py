"""Upstream tile servers and the city centres warmed at start-up, per region."""

UPSTREAMS = {
    "eu": "tiles-eu-2.maps.internal",
    "us": "tiles-us-1.maps.internal",
    "ap": "tiles-ap-4.maps.internal",
}

WARM = {
    "eu": [("Lyon", 45.7640, 4.8357), ("Gdansk", 54.3520, 18.6466)],
    "us": [("Tucson", 32.2226, -110.9747)],
    "ap": [("Osaka", 34.6937, 135.5023)],
}
