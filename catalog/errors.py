"""The catalog's user-facing error, and the category of its notes."""
from __future__ import annotations

from advisor.catalog.specs import SpecError


class CatalogError(SpecError):
    """A name, file or string given to the catalog cannot be resolved. One line for the user."""


class CatalogNote(UserWarning):
    """Something the catalog decided for the user that is not wrong (a default filled in for a
    missing field, an alias resolved to its model): the CLI prints it as one `note: ...` line."""


def did_you_mean(word: str, known, n: int = 1) -> str:
    """'; did you mean 'x'?' for the known key closest to `word` (difflib, cutoff 0.6), or ''."""
    import difflib

    close = difflib.get_close_matches(str(word), list(known), n=n, cutoff=0.6)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""
