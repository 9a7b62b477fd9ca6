"""raysim: a Ray-based simulator of differentially private, clustered federated learning."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("raysim")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
