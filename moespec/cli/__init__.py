"""moespec's command line: a thin dispatcher; each command is one module with
`add_arguments(parser)` and `run(args)`, and imports its heavy dependencies only when run."""

import argparse
import importlib
import sys

from moespec import __version__
from moespec.errors import cli_message

COMMANDS = {
    "generate": "moespec.cli.generate",
    "measure-verify": "moespec.cli.measure_verify",
    "plan": "moespec.cli.plan",
    "evaluate": "moespec.cli.evaluate",
    "staircase": "moespec.cli.staircase",
    "simulate": "moespec.cli.simulate",
    "trace": "moespec.cli.trace",
    "reuse": "moespec.cli.reuse",
    "synth-trace": "moespec.cli.synth_trace",
    "serve": "moespec.cli.serve",
    "convert": "moespec.cli.convert",
    "export-gguf": "moespec.cli.export_gguf",
    "env": "moespec.cli.env",
}


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line (as every other bad input is), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
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
    try:
        # Argument types are checked here, before any command imports torch.
        args = build_parser().parse_args(argv)
    except SystemExit as exit:  # a bad argument (2), --help or --version (0)
        return exit.code if isinstance(exit.code, int) else 2
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print(f"moespec {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`moespec reuse ... | head`): what it wanted it has.
        _silence_stdout()
        return 0
    except (ValueError, OSError) as error:
        # Bad input: one line naming what is wrong, exit status 2 (as argparse does).
        print(f"moespec {args.command}: error: {cli_message(error)}", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of the closed pipe
    does not print 'Exception ignored ... BrokenPipeError' on the way out."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a real file (tests capture it)
        pass


if __name__ == "__main__":
    sys.exit(main())
