"""`python -m raysim.cli`: the `raysim` command, as before the command line had a folder."""

from raysim.cli.main import entry

entry()
