"""The catalog's user-facing error, and the category of its notes."""
from __future__ import annotations

from advisor.catalog.specs import SpecError


class CatalogError(SpecError):
    """A name, file or string given to the catalog cannot be resolved. One line for the user."""


class CatalogNote(UserWarning):
    """Something the catalog decided for the user that is not wrong (a default filled in for a
    missing field, an alias resolved to its model): the CLI prints it as one `note: ...` line."""
