"""``python -m benchmarks.report [--write]``: print ``benchmarks/README.md``, or write it and the results table of
the top-level README."""

from __future__ import annotations

import argparse

from benchmarks.common import RESULTS
from benchmarks.report import README, TOP_README, render
from benchmarks.report.readme import with_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"write {README.relative_to(RESULTS.parents[1])}")
    args = parser.parse_args()
    text = render()
    if args.write:
        README.write_text(text)
        print(f"wrote {README} ({len(text.splitlines())} lines)")
        TOP_README.write_text(with_results(TOP_README.read_text()))
        print(f"wrote the results table of {TOP_README}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
