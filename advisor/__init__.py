"""advisor: auto-tuning advisor for distributed LLM training with thermal-aware placement."""
import os as _os

__version__ = "0.1.0"

# In a source checkout the layer folders beside this one (catalog/, models/, ...) are the advisor.*
# subpackages (pyproject's package-dir). When this package is imported from the checkout itself
# (`python -m advisor` in the repo root, PYTHONPATH=<repo>, a Ray worker started there) rather
# than from an install, look for the subpackages there too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "catalog")):
    __path__.append(_root)  # noqa: F821 - the package's own search path
