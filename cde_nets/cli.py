"""The ``cde-nets`` command: ``cde-nets experiments …`` and ``cde-nets benchmarks …``.

The same programs run as ``python -m cde_nets.experiments`` and ``python -m cde_nets.benchmarks``.
"""

from __future__ import annotations

import sys

from cde_nets.solvers.errors import did_you_mean

_COMMANDS = {
    "experiments": "reproductions of the papers' tables and figures (no name: list them with their times)",
    "benchmarks": "speed and memory against torchdiffeq, hand-written loops and momentumnet",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        lines = [f"  {name:12s} {what}" for name, what in _COMMANDS.items()]
        print(
            "usage: cde-nets {experiments,benchmarks} [options]\n\ncommands:\n"
            + "\n".join(lines)
            + "\n\n`cde-nets experiments --help` and `cde-nets benchmarks --help` list every experiment and "
            "benchmark."
        )
        if argv and argv[0] not in ("-h", "--help"):
            hint = did_you_mean(argv[0], _COMMANDS)
            print(f"\ncde-nets: unknown command {argv[0]!r}{hint}; use one of {', '.join(_COMMANDS)}.", file=sys.stderr)
            return 2
        return 0
    if argv[0] == "experiments":
        from cde_nets.experiments.__main__ import main as run
    else:
        from cde_nets.benchmarks.__main__ import main as run
    return run(argv[1:], prog=f"cde-nets {argv[0]}")


if __name__ == "__main__":
    sys.exit(main())
