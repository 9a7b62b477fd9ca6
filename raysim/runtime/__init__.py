"""The Ray side of a run and what it shares with the in-process loop: the coordinator, the
workers, the clients' side, checkpoints, sealed payloads."""
