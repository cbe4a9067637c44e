"""The catalog's user-facing error."""
from __future__ import annotations

from advisor.catalog.specs import SpecError


class CatalogError(SpecError):
    """A name, file or string given to the catalog cannot be resolved. One line for the user."""
