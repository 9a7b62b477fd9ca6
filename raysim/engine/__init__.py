"""The engine: an experiment prepared from its config (``experiment``), the round loop
(``rounds``) and the one driver around it (``driver``), the in-process loop (``inline``), and the
forked preparer the runtime's workers start from (``zygote``, ``sealed``). It never imports an
algorithm, Ray's placement (``raysim.runtime``) or the command line."""
