"""Privacy auditing: canaries through a mode's release path, empirical lower bounds on eps."""

# whether the adversary is told who took part (the command line checks it without loading torch)
PARTICIPATION = ("hidden", "told")
