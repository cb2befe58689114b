"""``python -m cde_nets.experiments <name>|all [--quick|--tiny] [--seed N] [--out results] [--resume]``.

Every training writes an atomic per-epoch checkpoint under ``OUT/checkpoints/<name>-<size>-seed<N>/``; after a
crash or a kill, the same command with ``--resume`` continues where each training stopped and ends with the
results of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from cde_nets.training import checkpointing

from .registry import REPRODUCTIONS, runner
from .report import format_table, write_result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distributed"]:  # the scale-out launcher, not a reproduction: its own options
        from .distributed import main as distributed
        return distributed(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m cde_nets.experiments", description=__doc__)
    parser.add_argument("name", nargs="?", default="all", help=f"one of: {', '.join(REPRODUCTIONS)}, or all")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="size", action="store_const", const="quick", help="reduced setting (main job)")
    size.add_argument("--tiny", dest="size", action="store_const", const="tiny", help="seconds (test suite)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results", help="directory for <name>.json and PNG plots")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--resume", action="store_true",
                        help="continue every training from its checkpoint in OUT/checkpoints (finished ones are not "
                             "retrained); the results equal an uninterrupted run's")
    parser.add_argument("--no-checkpoints", dest="checkpoints", action="store_false",
                        help="do not write per-epoch training checkpoints")
    parser.add_argument("--list", action="store_true", help="list the reproductions and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (_, desc) in REPRODUCTIONS.items():
            print(f"{name:24s} {desc}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    size = args.size or "full"
    names = list(REPRODUCTIONS) if args.name == "all" else [args.name]
    for name in names:
        runner(name)  # fail on an unknown name before any work starts
    t0 = time.perf_counter()
    if args.resume and not args.checkpoints:
        parser.error("--resume needs the checkpoints: drop --no-checkpoints")
    for name in names:
        ckpt_dir = Path(args.out) / "checkpoints" / f"{name}-{size}-seed{args.seed}"
        with checkpointing(ckpt_dir, resume=args.resume) if args.checkpoints else nullcontext():
            res = runner(name)(size=size, seed=args.seed, out_dir=args.out)
        path = write_result(res, args.out)
        print(format_table(res))
        print(f"\n(wrote {path})\n", flush=True)
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
