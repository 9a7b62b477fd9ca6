"""dp_accounting without its package ``__init__``, which runs only where it is needed.

``import dp_accounting`` runs the package's ``__init__``, which loads every accountant and its
calibration helpers and through them scipy.signal, scipy.stats and scipy.optimize: ~1.2-1.5
CPU-s and ~50 MiB. raysim needs the event classes (``dp_accounting.dp_event``: the standard
library and ``attr``) in every worker, and the RDP accountant (numpy and scipy.special) in every
calibration, which runs serially before Ray may start. So ``raysim.privacy`` registers the
package without running its ``__init__``: its submodules import as usual, each when first
imported or first asked for (``dp_accounting.pld``), and the ``__init__`` runs the first time a
name only it defines is asked for (``dp_accounting.DpEvent``), so code that uses the package as
usual finds it whole, with one set of classes (tests/test_imports.py). Where the package is
loaded already, nothing changes.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any


class _PackageOnDemand(types.ModuleType):
    """A package whose ``__init__`` runs when a name it defines is first asked for."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or self.__dict__.get("_raysim_init_ran"):
            # private names (and probes such as hasattr(m, "__path__")) are not the package's
            # API; while (or after) the __init__ runs, a missing name is missing
            raise AttributeError(name)
        if importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
            # a submodule, which the package's __init__ would have imported: imported alone
            return importlib.import_module(f"{self.__name__}.{name}")
        self.__dict__["_raysim_init_ran"] = True
        self.__spec__.loader.exec_module(self)  # the package's own __init__, in this module
        return getattr(self, name)


def package_on_demand(name: str) -> None:
    """Register package ``name`` (not imported yet) so that its ``__init__`` runs on demand."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)  # finds the package; runs none of it
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return  # an unusual install: imported as usual
    package = _PackageOnDemand(name)
    package.__spec__ = spec
    package.__loader__ = spec.loader
    package.__file__ = spec.origin
    package.__path__ = list(spec.submodule_search_locations)
    package.__package__ = name
    sys.modules[name] = package
