"""The CUDA checks: every CUDA path of the trainer end to end, through the real launcher on
generated images (``python -m pytest -m cuda tests/``; skipped without CUDA)."""
