"""`keras-gpufix` command line: a thin shell over library functions."""

import argparse

from keras_gpufix import __version__

__all__ = ["main", "build_parser"]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-gpufix",
        description="Find why the GPU idles while model.fit trains, and fix it.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv=None) -> int:
    """Runs the CLI; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 2
