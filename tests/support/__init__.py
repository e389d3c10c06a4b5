"""What the tests import, and bench/ shares: generated image folders and tools run as a user
runs them (``harness``), the host-device sync audit of a training epoch (``sync_audit``), and
launcher runs in folders of their own, read back (``folder_runs``)."""
