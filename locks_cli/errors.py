"""One-line user errors: what was wrong and how to fix it, printed without a traceback."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

# soft_wrap: a message is one line that the terminal wraps; rich would otherwise break a long path
# inside a word, and the path could no longer be copied.
stderr_console = Console(stderr=True, soft_wrap=True)


def fail(message: str, hint: str | None = None, code: int = 2) -> "typer.Exit":
    """Print `error: message` (+ `hint:`) to stderr and return the Exit to raise."""
    stderr_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    if hint:
        stderr_console.print(f"[yellow]hint:[/] {escape(hint)}", highlight=False)
    return typer.Exit(code)
