"""The command line: ``raysim`` (``main``) and its commands (``compare``, ``audit``, ``attack``,
``list``); the top layer, the only one that looks algorithms up by name."""
