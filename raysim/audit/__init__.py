"""Privacy auditing: canaries through a mode's release path, empirical lower bounds on eps."""

# whether the adversary is told who took part (the command line checks it without loading torch)
PARTICIPATION = ("hidden", "told")
# what the adversary sees: what the mode admits to the server, or only the final models
ADVERSARY = ("white-box", "black-box")
# the black-box audit's canaries per mode: mislabelled inputs (raysim.audit.inputs), canary
# clients (raysim.audit.clients), canary clients releasing one of a pair (metric DP)
INPUT_MODES = ("sample", "none")
CLIENT_MODES = ("client", "distributed")
PAIR_MODES = ("dprivacy",)
