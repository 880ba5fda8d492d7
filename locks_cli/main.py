"""The `locks` console script: one typer group per concern (bench, eval, report)."""

from __future__ import annotations

import logging
import sys

import typer

from .bench import app as bench_app
from .eval import app as eval_app
from .report import app as report_app

app = typer.Typer(
    name="locks",
    help="Decide whether Locks sparse decode attention is worth deploying: measure speed, quality and fidelity.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(bench_app, name="bench")
app.add_typer(eval_app, name="eval")
app.add_typer(report_app, name="report")


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level to stderr.")) -> None:
    """Logs go to stderr; data and tables to stdout."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def with_default_eval_command(argv: list[str]) -> list[str]:
    """`locks eval --suite ruler ...` means `locks eval run --suite ruler ...` (the suites are the default)."""
    head = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if head is None or argv[head] != "eval" or head + 1 >= len(argv):
        return argv
    following = argv[head + 1]
    if following.startswith("-") and following not in ("--help", "-h"):
        return [*argv[: head + 1], "run", *argv[head + 1 :]]
    return argv


def cli() -> None:
    """The console script."""
    sys.argv[1:] = with_default_eval_command(sys.argv[1:])  # records reproduce the command as run
    app()


if __name__ == "__main__":  # `python -m locks_toolkit.locks_cli.main` without the console script
    cli()
