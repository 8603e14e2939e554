#!/usr/bin/env python3
"""Keep every core busy, to run the test suite or a benchmark on a loaded machine.

    python3 tools/cpu-load.py                 # one busy process per core until Ctrl-C
    python3 tools/cpu-load.py --procs 2 --seconds 600
    python3 tools/cpu-load.py -- make test    # busy while the command runs; its exit status

Each worker spins on integer arithmetic (no memory traffic to speak of, no threads of its own),
so it takes a core from whatever else runs, the way another user's job on a shared node does.
Workers are killed when the command ends, after --seconds, or on Ctrl-C/TERM.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import time


def spin(stop_at: float) -> None:
    x = 0
    while time.monotonic() < stop_at:
        for i in range(100_000):
            x = (x * 1103515245 + i) & 0xFFFFFFFF


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1, help="busy processes")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("command", nargs="*", help="run this while busy; exit with its status")
    args = parser.parse_args()
    if args.procs < 1:
        parser.error("--procs must be at least 1")
    if args.seconds is not None and not args.seconds > 0:
        parser.error("--seconds must be > 0")
    stop_at = time.monotonic() + (args.seconds if args.seconds is not None else 10**9)
    workers = [
        multiprocessing.Process(target=spin, args=(stop_at,), daemon=True)
        for _ in range(args.procs)
    ]
    for w in workers:
        w.start()
    print(
        f"cpu-load: {args.procs} busy processes (pids {', '.join(str(w.pid) for w in workers)})",
        file=sys.stderr,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.command:
            return subprocess.call(args.command)
        for w in workers:
            w.join()
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        for w in workers:
            w.kill()


if __name__ == "__main__":
    sys.exit(main())
