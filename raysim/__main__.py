"""`python -m raysim`: the `raysim` command."""

from raysim.cli import entry

entry()
