"""Every rank rule: the process group, collectives, per-rank logs, NCCL checks."""
