"""Lazy public names: a package's names load on first use (PEP 562)."""

import importlib
import sys

__all__ = ["lazy_getattr"]


def lazy_getattr(package, exports, submodules=()):
    """Returns a module `__getattr__` that imports `exports[name]` on demand.

    Args:
        package: the package's `__name__`.
        exports: public name -> module path that defines it.
        submodules: names of submodules to import on attribute access.
    """

    def __getattr__(name):
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
