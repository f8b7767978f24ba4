#!/usr/bin/env python3
"""A stand-in for the platform writing the HCCL rank table (`jobstart_hccl.json`) into a running container.

What a reader of the file must survive, in this order:

1. the file is missing for `--delay-create` seconds;
2. it is created empty and filled in `--pieces` writes, `--piece-delay` seconds apart, so truncated JSON is
   visible in between (never written atomically);
3. it says `"status": "initializing"` for `--initializing` seconds (forever with `--never-complete`);
4. it is rewritten in place, again in pieces, with the completed table.

The completed table is `--table FILE` byte for byte (a template two saying `"status": "completed"`), or the
platform's one-device example. Each step is printed on stdout as `<event> <time.time()>`; `completing` is taken
just before the last piece of the completed table is written, so no reader can have seen it complete earlier.
`--stamp FILE` also gets that time. Standard library only; stops at SIGTERM/SIGKILL like any process.
"""

import argparse
import json
import os
import sys
import time

PLATFORM_EXAMPLE = {
    "group_count": "1",
    "group_list": [
        {
            "device_count": "1",
            "group_name": "job-trainjob",
            "instance_count": "1",
            "instance_list": [
                {
                    "devices": [{"device_id": "4", "device_ip": "192.1.10.254"}],
                    "pod_name": "jobxxxxxxxx-job-trainjob-0",
                    "server_id": "192.168.0.25",
                }
            ],
        }
    ],
    "status": "completed",
}


def event(name: str) -> float:
    now = time.time()
    print(f"{name} {now:.6f}", flush=True)
    return now


def split(text: str, pieces: int):
    size = max(1, -(-len(text) // max(1, pieces)))
    return [text[start : start + size] for start in range(0, len(text), size)]


def write_in_pieces(path: str, text: str, pieces: int, delay: float, last_event: str = "") -> float:
    """Truncates the file, then writes `text` piece by piece, flushing each, sleeping between.

    Returns the time taken just before the last piece (when `last_event` is given, also printed).
    """
    parts = split(text, pieces)
    before_last = time.time()
    with open(path, "w", encoding="utf-8") as handle:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            if last:
                before_last = event(last_event) if last_event else time.time()
            handle.write(part)
            handle.flush()
            if not last:
                time.sleep(delay)
    return before_last


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="the file to write (its directory must exist)")
    parser.add_argument("--table", help="template two to write when completed (default: the platform's example)")
    parser.add_argument("--delay-create", type=float, default=0.0, help="seconds before the file appears")
    parser.add_argument("--pieces", type=int, default=3, help="writes per version of the file")
    parser.add_argument("--piece-delay", type=float, default=0.2, help="seconds between two pieces")
    parser.add_argument("--initializing", type=float, default=1.0, help="seconds the file says initializing")
    parser.add_argument("--never-complete", action="store_true", help="stay initializing until killed")
    parser.add_argument("--stamp", help="file that gets the completing time, as text")
    args = parser.parse_args(argv)

    if args.table:
        with open(args.table, encoding="utf-8") as handle:
            completed = handle.read()
    else:
        completed = json.dumps(PLATFORM_EXAMPLE, indent=4) + "\n"
    document = json.loads(completed)
    if document.get("status") != "completed":
        parser.error(f"{args.table}: the table to write must say status completed")
    initializing = json.dumps({**document, "status": "initializing"}, indent=4) + "\n"

    event("started")
    time.sleep(args.delay_create)
    event("creating")
    write_in_pieces(args.path, initializing, args.pieces, args.piece_delay)
    event("initializing")
    if args.never_complete:
        while True:
            time.sleep(3600)
    time.sleep(args.initializing)
    stamp = write_in_pieces(args.path, completed, args.pieces, args.piece_delay, last_event="completing")
    event("completed")
    if args.stamp:
        tmp = f"{args.stamp}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(f"{stamp:.6f}\n")
        os.replace(tmp, args.stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
