"""Saving and restoring a session vs rebuilding it by re-prefilling its transcript, on the default model.

For each logical length, a session under a slot cap (the default policy with its rules switched to SnapKV,
so the run measures persistence, not compaction cost) takes that many tokens of frozen source text; then:
save time and file size, load time, and the time to rebuild the same transcript in a new session under the
same policy (what a restart costs without a saved cache). Also checks that the loaded session's next-token
logits equal the saved one's bit for bit.

    python -m benchmarks.persistence [--lengths 2048 8192 32768] [--cap 2048]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import BENCH_MODEL, median_time, save, table
from benchmarks.texts import source_text
from kvmemory import Engine, MemoryManager, default_policy


def snapkv_policy(cap: int):
    policy = default_policy(max_slots=cap)
    switch = {"method": "snapkv", "params": {}, "query_source": "window"}
    rules = [r if r.protected else r.model_copy(update=switch) for r in policy.rules]
    return policy.model_copy(update={"rules": rules, "default": policy.default.model_copy(update=switch)})


def measure(engine, ids: list[int], cap: int, folder: Path) -> dict:
    session = engine.session(memory=MemoryManager(snapkv_policy(cap)))
    started = time.perf_counter()
    session.append_tokens(ids)
    rebuild = time.perf_counter() - started
    path = folder / f"{len(ids)}.kvm"
    save_s = median_time(lambda: session.save(path))
    load_s = median_time(lambda: engine.load_session(path).close())
    loaded = engine.load_session(path)
    probe = ids[:16]
    return {
        "logical_tokens": len(ids),
        "slots": session.cache.slots_per_head,
        "file_mb": path.stat().st_size / 1e6,
        "save_s": save_s,
        "load_s": load_s,
        "rebuild_s": rebuild,
        "load_vs_rebuild": rebuild / load_s,
        "identical_logits": bool(torch.equal(loaded.logprobs(probe), session.logprobs(probe))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--cap", type=int, default=2048)
    args = parser.parse_args()
    engine = Engine.from_pretrained(BENCH_MODEL)
    text = engine.tokenizer.encode(source_text(200_000), add_special_tokens=False)
    ids = (text * (max(args.lengths) // len(text) + 1))[: max(args.lengths)]
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for n in args.lengths:
            rows.append(measure(engine, ids[:n], args.cap, Path(tmp)))
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, list(rows[0])))
    formats = {"weights": engine.weights, "kv_dtype": str(engine.kv_dtype).removeprefix("torch.")}
    print(f"saved {save('persistence', {'cap': args.cap, **formats, 'rows': rows})}")


if __name__ == "__main__":
    main()
