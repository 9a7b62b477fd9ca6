"""raysim: a Ray-based simulator of differentially private, clustered federated learning."""

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "raysim-dpfl"  # the name on PyPI ("raysim" there is another project)

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
