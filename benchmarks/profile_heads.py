"""Profile a named model's KV heads for REAL and ship the profile with the package, so that no user's first
compaction stops to profile (``kvmemory/runtime/head_profiles/``).

python -m benchmarks.profile_heads [--model qwen2.5-coder-0.5b] [--cases 8]
"""

from __future__ import annotations

import argparse
import time

from kvmemory import Engine
from kvmemory.runtime.head_profiling import SHIPPED_DIR, profile_heads
from kvmemory.runtime.named_models import NAMED_MODELS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--model", default="default", choices=["default", *NAMED_MODELS])
    args = parser.parse_args()
    engine = Engine.from_pretrained(args.model)
    start = time.perf_counter()
    profile = profile_heads(engine, cases=args.cases, model_name=engine.name)
    path = profile.save(SHIPPED_DIR / f"{engine.name}.json")
    print(
        f"{profile.correct}/{profile.cases} needle cases answered correctly; profiled in "
        f"{time.perf_counter() - start:.1f} s"
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
