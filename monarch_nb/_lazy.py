"""Lazy package attributes: ``import monarch_nb`` (or a subpackage) imports nothing heavy until a
name is used (PEP 562 module ``__getattr__``)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str], namespace: dict,
                 not_provided: dict[str, str] | None = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package`` whose names live in other modules.

    ``exports`` maps a public name to the module that defines it; a name is imported on first
    use and then cached in ``namespace`` (the package's ``globals()``). ``not_provided`` maps
    names of the API this package mirrors (Monarch's) that it does not have to what to use
    instead: asking for one raises ImportError with that text (an ImportError, not an
    AttributeError, so that ``from package import name`` shows it rather than a bare "cannot
    import name").
    """
    missing = not_provided or {}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            if name in missing:
                raise ImportError(f"{package} does not provide Monarch's {name!r}: {missing[name]} "
                                  "(docs/compatibility.md lists each of Monarch's names)", name=name)
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
