"""The `advisor` command line. Each command group lives in its own `cmd_*.py` module and
registers itself on `app`; this module only wires them and turns user errors into one line."""
from __future__ import annotations

import importlib
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
    "advisor.cmd_report",
    "advisor.cmd_plan",
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


def _version(value: bool) -> None:
    if value:
        from advisor import __version__

        typer.echo(f"advisor {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main_options(
    version: bool = typer.Option(False, "--version", help="print the version and exit", is_eager=True,
                                 callback=_version),
) -> None:
    """Auto-tuning advisor for distributed LLM training: layouts, memory, speed, power, placement."""


def fail(message: str, code: int = 2) -> "typer.Exit":
    """Print one clear line on stderr and exit with `code` (2 = bad input)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


# click's exceptions: typer >= 0.2x vendors its own copy of click, older ones use click itself;
# typer.BadParameter lives in whichever is in use
_click_exc = importlib.import_module(typer.BadParameter.__module__)
_ClickException = _click_exc.ClickException
_NoArgsIsHelpError = getattr(_click_exc, "NoArgsIsHelpError", None)  # click >= 8.2


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Python warnings (e.g. the catalog's on an HF config) as one `warning: ...` line each, once;
    the catalog's notes (a default filled in, an alias resolved) as one `note: ...` line."""
    from advisor.catalog.errors import CatalogNote

    kind = "note" if issubclass(category, CatalogNote) else "warning"
    text = f"{kind}: {_one_line(message)}"
    if text not in _warned:
        _warned.add(text)
        print(text, file=sys.stderr)


_warned: set[str] = set()


def main(argv: list[str] | None = None) -> None:
    """Run the CLI. Usage errors (bad values, unknown or missing options, unknown commands) and
    the tool's own input errors print one line `error: ...` on stderr and exit 2; `--help` and a
    bare `advisor` print the help as usual. Every command's parameters go through
    advisor.validate first; a missing extra names its install command; an unexpected failure is
    one line too (ADVISOR_DEBUG=1 shows its traceback)."""
    import os
    import warnings

    import typer.main

    from advisor import validate

    _register_all()
    warnings.showwarning = _show_warning
    debug = bool(os.environ.get("ADVISOR_DEBUG"))
    try:
        command = typer.main.get_command(app)
        validate.install(command)
        # standalone_mode=False: click raises its usage errors here instead of printing a boxed
        # block; typer.Exit / ctx.exit(code) come back as the return value
        rv = command.main(args=argv, standalone_mode=False, prog_name="advisor")
    except _ClickException as e:  # UsageError (exit 2) and its kin, FileError (exit 1)
        if _NoArgsIsHelpError is not None and isinstance(e, _NoArgsIsHelpError):
            # a bare `advisor`: the help, exit 2 as click does (typer's rich help has already
            # printed itself and left the message empty)
            if e.format_message().strip():
                typer.echo(e.format_message(), err=True)
            sys.exit(e.exit_code)
        typer.echo(f"error: {_one_line(e.format_message())}", err=True)
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(1)
    except SpecError as e:
        typer.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(2)
    except FileNotFoundError as e:
        typer.echo(f"error: {e.filename or e}: no such file", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except ModuleNotFoundError as e:  # an optional extra that is not installed
        hint = validate.install_hint(e.name or "")
        if hint is None or debug:
            raise
        typer.echo(f"error: this needs {hint}", err=True)
        sys.exit(2)
    except OSError as e:  # a file the checks could not foresee (full disk, a file removed meanwhile)
        if debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        typer.echo(f"error: {where}{e.strerror or _one_line(e)}", err=True)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback on demand
        if debug:
            raise
        typer.echo(f"error: internal error ({type(e).__name__}: {_one_line(e)[:300]}); "
                   f"ADVISOR_DEBUG=1 shows the traceback", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


if __name__ == "__main__":
    main()
