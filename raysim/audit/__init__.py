"""Privacy auditing: canaries through a mode's release path, empirical lower bounds on eps."""
