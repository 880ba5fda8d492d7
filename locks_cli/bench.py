"""`locks bench`: Speed: matched-pair engine sessions and kernel profiles."""

from __future__ import annotations

import typer

app = typer.Typer(help="Speed: matched-pair engine sessions and kernel profiles.", no_args_is_help=True)
