"""Every rank rule: the process group, collectives, per-rank logs, the heartbeat, NCCL checks."""
