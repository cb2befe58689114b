"""``python -m cde_nets.experiments [<name>|all] [--quick|--tiny] [--seed N] [--seeds N] [--workers N] [--out results]
[--resume]`` (also ``cde-nets experiments …``).

A training reproduction at the full setting runs over 5 seeds (``--seed``, ``--seed + 1``, …; ``--seeds`` changes
the count; quick and tiny keep one), in ``--workers`` parallel processes, and reports per row the mean ± standard
deviation and the range, the per-seed numbers kept in the JSON (:mod:`experiments.seeds`).

With no name it lists the reproductions and their running times; ``all`` runs every one. Every training writes an
atomic per-epoch snapshot under ``OUT/snapshots/<name>-<size>-seed<N>/``; after a crash or a kill, the same
command with ``--resume`` continues where each training stopped and ends with the results of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

import torch

from cde_nets.solvers.errors import did_you_mean
from cde_nets.train.snapshots import RunInUseError, RunLock, SnapshotError

from .reference import attach
from .registry import REPRODUCTIONS, THREADS, THREADS_OF, recorded_only, threads_for, times, total
from .report import format_table, write_result
from .seeds import cores, default_seeds, default_workers, run_one, run_seeds, side_by_side


def _seconds(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 1:
        return "<1 s"
    return f"{s:.0f} s" if s < 100 else f"{s / 60:.0f} min"


def _default_threads() -> str:
    """``1, 2 for nais_digits``: the threads each reproduction runs on unless ``--threads`` says otherwise."""
    return ", ".join([str(THREADS)] + [f"{n} for {name}" for name, n in THREADS_OF.items()])


def listing() -> str:
    """The reproductions, one a line: name, seconds at each setting (— where never timed), description; the
    ``all`` row sums each column."""
    lines = [f"  {'name':18s} {'tiny':>7s} {'quick':>7s} {'full':>8s}  what"]
    for name, (_, desc) in REPRODUCTIONS.items():
        t = times(name)
        full = _seconds(t.get("full")) + ("*" if recorded_only(name) else " ")
        cells = f"{_seconds(t.get('tiny')):>7s} {_seconds(t.get('quick')):>7s} {full:>8s}"
        lines.append(f"  {name:18s} {cells}  {desc}")
    recorded = any(recorded_only(name) for name in REPRODUCTIONS)
    full = _seconds(total("full")) + ("*" if recorded and total("full") is not None else " ")
    sums = " ".join(f"{_seconds(total(size)):>7s}" for size in ("tiny", "quick")) + f" {full:>8s}"
    lines.append(f"  {'all':18s} {sums}  every one of them (the sum of each column; side by side at one seed)")
    notes = [
        "  Measured by `python -m cde_nets.experiments.timings` (a fresh process each, on its default torch threads:",
        f"  {_default_threads()}); the dates and the machine's load at each measurement are in",
        "  experiments/timings.json.",
    ]
    if recorded:
        notes.append("  * the recorded full run's own time (not yet measured by the timing script).")
    return "\n".join(lines + notes)


def _epilog() -> str:
    from cde_nets.benchmarks.__main__ import listing as benchmark_listing

    return (
        f"reproductions (seconds at each setting on 2 CPU cores):\n"
        f"{listing()}\n\n"
        "  distributed        the scale-out launcher, not a reproduction: `python -m cde_nets.experiments "
        "distributed --help`\n\n"
        f"benchmarks (`cde-nets benchmarks [--tiny] [--only NAME ...]`):\n{benchmark_listing()}\n\n"
        "examples:\n  cde-nets experiments all --quick      every reproduction, reduced setting (the main job)\n"
        "  cde-nets experiments hdnn_fig4 --tiny  one reproduction in seconds"
    )


_DESCRIPTION = """\
Reproduces the papers' tables and figures. With no name it lists the reproductions and their running times; `all`
runs every one. Every training writes a per-epoch snapshot under OUT/snapshots/<name>-<size>-seed<N>/; after
a crash or a kill, the same command with --resume continues where each training stopped and ends with the results
of an uninterrupted run."""


def _results(names: list[str], size: str, args: argparse.Namespace) -> Iterator[tuple[str, dict]]:
    """Each reproduction's result in order. Several at one seed each (``all --quick``) run side by side in worker
    processes, as many as the cores hold their threads (``--workers`` caps them): each is the same computation, on
    the same threads, as alone; a reproduction over several seeds runs its seeds in parallel instead."""
    threads = {name: args.threads or threads_for(name) for name in names}
    seeds = {name: args.seeds or default_seeds(name, size) for name in names}
    budget, workers = cores(), args.workers or cores()
    if len(names) > 1 and all(n == 1 for n in seeds.values()) and workers > 1 and budget > min(threads.values()):
        jobs = [
            (name, threads[name], (name, size, args.seed, args.out, threads[name], args.resume, args.snapshots))
            for name in names
        ]
        yield from side_by_side(jobs, budget, workers)
        return
    for name in names:
        torch.set_num_threads(threads[name])
        if seeds[name] > 1:
            yield (
                name,
                run_seeds(
                    name,
                    size,
                    list(range(args.seed, args.seed + seeds[name])),
                    args.out,
                    workers=args.workers or default_workers(seeds[name], threads[name]),
                    threads=threads[name],
                    resume=args.resume,
                    snapshots=args.snapshots,
                ),
            )
        else:
            yield name, run_one(name, size, args.seed, args.out, threads[name], args.resume, args.snapshots)


def _parser(prog: str) -> argparse.ArgumentParser:
    """The command line: a reproduction's name, its size, seeds, workers, output folder, threads and snapshots."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=_DESCRIPTION,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "name", nargs="?", default=None, help="a reproduction (listed below) or all; without one, list them and exit"
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="size", action="store_const", const="quick", help="reduced setting (main job)")
    size.add_argument("--tiny", dest="size", action="store_const", const="tiny", help="seconds (test suite)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds per reproduction: --seed, --seed + 1, ... (default: 5 for a training reproduction at the full "
        "setting, 1 otherwise); each seed's result is kept in OUT/seeds/",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="parallel processes: a reproduction's seeds, or under `all` at one seed the reproductions side by side "
        "(default: as many as the cores hold at their threads)",
    )
    parser.add_argument("--out", default="results", help="directory for <name>.json and PNG plots")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"torch intra-op threads per reproduction (default {_default_threads()}: on problems this small a "
        "second thread costs more than it gives)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue every training from its snapshot in OUT/snapshots (finished ones are not "
        "retrained); the results equal an uninterrupted run's",
    )
    parser.add_argument(
        "--no-snapshots", dest="snapshots", action="store_false", help="do not write per-epoch training snapshots"
    )
    parser.add_argument("--list", action="store_true", help="list the reproductions and exit (as with no name)")
    return parser


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse seeds, threads and workers out of range, before any work starts."""
    if not 0 <= args.seed < 2**32:  # numpy's and torch's generators both take it
        parser.error(f"--seed must be an integer in [0, 2**32), got {args.seed}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be a positive integer (torch intra-op threads), got {args.threads}")
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds must be a positive integer (how many seeds to run), got {args.seeds}")
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be a positive integer (parallel processes), got {args.workers}")
    if args.seeds is not None and args.seed + args.seeds > 2**32:
        parser.error(f"--seed + --seeds must stay within 2**32, got {args.seed} + {args.seeds}")


def main(argv: list[str] | None = None, prog: str = "python -m cde_nets.experiments") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distributed"]:  # the scale-out launcher, not a reproduction: its own options
        from .distributed import main as distributed

        return distributed(argv[1:], prog=f"{prog} distributed")
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.list or args.name is None:
        print("reproductions (seconds at each setting on 2 CPU cores; — where not measured):")
        print(listing())
        print(
            "\nrun one:  cde-nets experiments NAME [--quick|--tiny]\nrun all:  cde-nets experiments all --quick"
            "   (the main job; `all` alone runs the full setting)\nmore:     cde-nets experiments --help"
        )
        return 0
    _check_numbers(parser, args)
    size = args.size or "full"
    names = list(REPRODUCTIONS) if args.name == "all" else [args.name]
    for name in names:
        if name not in REPRODUCTIONS:  # fail on an unknown name before any work starts
            hint = did_you_mean(name, [*REPRODUCTIONS, "all"])
            parser.error(f"unknown reproduction {name!r}{hint}; choose one of: {', '.join(REPRODUCTIONS)} or 'all'")
    if args.resume and not args.snapshots:
        parser.error("--resume needs the snapshots: drop --no-snapshots")
    try:
        # one run per output folder, checked writable before any training (a run must not lose its results)
        lock = RunLock(args.out).__enter__()
    except (OSError, RunInUseError) as exc:
        parser.error(str(exc))
    try:
        t0 = time.perf_counter()
        for _name, res in _results(names, size, args):
            res = attach(res)
            path = write_result(res, args.out)
            print(format_table(res))
            print(f"\n(wrote {path})\n", flush=True)
        print(f"total {time.perf_counter() - t0:.1f} s")
    except SnapshotError as exc:
        # a snapshot that cannot be resumed from: its own message names the file and the fix; nothing is deleted
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        lock.__exit__()
    return 0


if __name__ == "__main__":
    sys.exit(main())
