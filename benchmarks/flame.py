"""Summarise py-spy's collapsed stacks (`py-spy record -f raw`): share of samples per function, inclusive.

python -m benchmarks.flame benchmarks/out/profile-web.txt [--top 30]
"""

from __future__ import annotations

import argparse
from collections import Counter


def inclusive_shares(lines: list[str]) -> tuple[int, Counter]:
    """(total samples, samples per `function (file)` counted once per stack it appears in)."""
    shares: Counter = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        seen = set()
        for frame in stack.split(";"):
            name, _, where = frame.partition(" (")
            key = f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})" if where else name
            if key not in seen:
                seen.add(key)
                shares[key] += int(count)
    return total, shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.path) as handle:
        total, shares = inclusive_shares(handle.readlines())
    print(f"{total} samples")
    for key, count in shares.most_common(args.top):
        print(f"{count * 100 / max(total, 1):5.1f}%  {key}")


if __name__ == "__main__":
    main()
