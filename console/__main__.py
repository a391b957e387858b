"""`python -m console`: the operator console on a gateway's live feed, or a recording of one."""
from __future__ import annotations

import argparse
import os
import sys

from console.app import ConsoleApp
from console.feed import LiveFeed, Recorder, ReplayFeed
from console.terminal import NoTerminal, on_a_terminal


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m console", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--url", default="http://127.0.0.1:8000",
                     help="the gateway's base URL (default %(default)s)")
    src.add_argument("--replay", metavar="FILE", help="play a recorded feed instead of a gateway")
    p.add_argument("--api-key", default=os.environ.get("INFERSTACK_ADMIN_KEY"),
                   help="an admin API key (default: $INFERSTACK_ADMIN_KEY)")
    p.add_argument("--record", metavar="FILE", help="save every frame received to FILE (JSONL)")
    p.add_argument("--speed", type=float, default=1.0,
                   help="replay speed, times real time; 0 = as fast as possible (default 1)")
    p.add_argument("--fleet-gpus", type=int, default=128,
                   help="fleet size for the annual revenue projection (default %(default)s)")
    args = p.parse_args(argv)
    if args.record and args.replay:
        p.error("--record saves a live feed; it cannot be used with --replay")
    if args.fleet_gpus < 1:
        p.error("--fleet-gpus must be 1 or more")
    if args.speed < 0:
        p.error("--speed must be 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recorder = Recorder(args.record) if args.record else None
    source: ReplayFeed | LiveFeed
    if args.replay:
        source = ReplayFeed(args.replay, speed=args.speed)
    else:
        source = LiveFeed(args.url, args.api_key, recorder=recorder)
    try:
        with on_a_terminal():  # Textual draws on stderr: even with stderr redirected
            ConsoleApp(source, fleet_gpus=args.fleet_gpus).run()
    except NoTerminal as exc:
        print(f"python -m console: {exc}", file=sys.stderr)
        return 2
    finally:
        if recorder is not None:
            recorder.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
