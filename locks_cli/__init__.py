"""Typer commands of the `locks` console script: parse, validate, call one library function."""
