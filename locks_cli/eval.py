"""`locks eval`: Quality: selection fidelity (microscope) and task suites over a budget grid."""

from __future__ import annotations

import typer

app = typer.Typer(help="Quality: selection fidelity (microscope) and task suites over a budget grid.", no_args_is_help=True)
