"""What stop strings cost per generated token on the event loop (``StopChecker``).

Per case: microseconds per delta (3 characters, about a token) over a text in which no stop
string occurs, so every delta is checked and released; the best of ``--repeats`` runs. The
worst case at the server's limits is 32 stop strings of 1,024 characters that the text keeps
matching long prefixes of. Also what building the checker costs (once per request).

    python scripts/bench_stop_strings.py [--chars 30000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

from pd.server.detokenizer import StopChecker

LIMIT_STOPS = ["a" * k + "c" + "a" * (1023 - k) for k in range(31)] + ["a" * 1023 + "b"]
CASES = {
    "no stop strings": [],
    "4 short stop strings": ["\n\n", "</s>", "User:", "###"],
    "32 x 1,024 characters (the limits)": LIMIT_STOPS,
}


def per_delta_us(stop: list[str], deltas: list[str], repeats: int) -> tuple[float, float]:
    """(best microseconds per delta, milliseconds to build the checker)."""
    best, build = float("inf"), float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        checker = StopChecker(stop)
        t1 = time.perf_counter()
        for d in deltas:
            checker.step(d)
        t2 = time.perf_counter()
        best, build = min(best, (t2 - t1) / len(deltas) * 1e6), min(build, (t1 - t0) * 1e3)
    return best, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chars", type=int, default=30000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    unit = "a" * 1500 + "d" + "a" * 20 + "c" + "a" * 5 + "d"
    text = (unit * (args.chars // len(unit) + 1))[: args.chars]
    deltas = [text[i : i + 3] for i in range(0, len(text), 3)]
    for name, stop in CASES.items():
        us, build_ms = per_delta_us(stop, deltas, args.repeats)
        print(f"{name:36s} {us:7.2f} us/token   build {build_ms:7.2f} ms")


if __name__ == "__main__":
    main()
