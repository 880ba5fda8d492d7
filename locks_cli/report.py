"""`locks report`: Markdown tables and plots from stored result records."""

from __future__ import annotations

import typer

app = typer.Typer(help="Markdown tables and plots from stored result records.", no_args_is_help=True)
