"""`locks eval`: Quality: selection fidelity (microscope) and task suites over a budget grid."""

from __future__ import annotations

import typer

from .eval_microscope import microscope
from .eval_run import run

app = typer.Typer(help="Quality: selection fidelity (microscope) and task suites over a budget grid.", no_args_is_help=True)
app.command("microscope")(microscope)
app.command("run")(run)
