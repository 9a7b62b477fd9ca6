"""`python -m raysim`: the `raysim` command."""

from raysim.cli.main import entry

entry()
