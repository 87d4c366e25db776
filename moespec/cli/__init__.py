"""moespec's command line: a thin dispatcher; each command is one module with
`add_arguments(parser)` and `run(args)`, and imports its heavy dependencies only when run."""

import argparse
import importlib
import sys

from moespec import __version__

COMMANDS = {
    "generate": "moespec.cli.generate",
    "measure-verify": "moespec.cli.measure_verify",
    "plan": "moespec.cli.plan",
    "staircase": "moespec.cli.staircase",
    "simulate": "moespec.cli.simulate",
    "trace": "moespec.cli.trace",
    "reuse": "moespec.cli.reuse",
    "synth-trace": "moespec.cli.synth_trace",
    "serve": "moespec.cli.serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moespec",
        description="Mixture-of-Experts inference with speculative decoding, decided from "
        "measurement.",
    )
    parser.add_argument("--version", action="version", version=f"moespec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print(f"moespec {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as error:
        # Bad input: one line naming what is wrong, exit status 2 (as argparse does).
        print(f"moespec {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
