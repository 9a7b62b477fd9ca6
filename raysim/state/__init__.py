"""Run state a user can trust: the run directory (``rundir``: placing, refusing, recording) and
the checkpoint (``checkpoint``: data only, decoded by a restricted decoder)."""
