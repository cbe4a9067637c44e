"""The `advisor` command line. Each command group lives in its own `cmd_*.py` module and
registers itself on `app`; this module only wires them and turns user errors into one line."""
from __future__ import annotations

import sys

import typer

from advisor.catalog.specs import SpecError

app = typer.Typer(
    name="advisor",
    help="Auto-tuning advisor for distributed LLM training: layouts, memory, speed, power, placement.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command modules: each defines register(app). Imported lazily-cheap (no torch, no ray at import).
_COMMAND_MODULES = (
    "advisor.cmd_catalog",
    "advisor.cmd_recommend",
    "advisor.cmd_measure",
    "advisor.cmd_tune",
    "advisor.cmd_fit",
    "advisor.cmd_place",
)


def _register_all() -> None:
    import importlib

    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # command not built yet
                continue
            raise
        mod.register(app)


def fail(message: str, code: int = 2) -> "typer.Exit":
    """Print one clear line on stderr and exit with `code` (2 = bad input)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def main(argv: list[str] | None = None) -> None:
    _register_all()
    try:
        app(args=argv, standalone_mode=True)
    except SpecError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except FileNotFoundError as e:
        typer.echo(f"error: {e.filename or e}: no such file", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
