"""Objects pickled where they were built and unpickled only where they are used.

`raysim run` prepares its experiment (data, model initialisation, the algorithm with its
calibrated noise) in a short-lived child process and hands the algorithm and the model spec to
the actors sealed: the driver passes the bytes through and never imports torch, which would cost
it ~150 MiB for the whole run (docs/speed.md). The actors open them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sealed:
    blob: bytes

    @classmethod
    def of(cls, obj: Any) -> Sealed:
        return cls(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def open(self) -> Any:
        return pickle.loads(self.blob)


def opened(obj: Any) -> Any:
    """``obj`` itself, or what it seals."""
    return obj.open() if isinstance(obj, Sealed) else obj
