"""The step, the epoch loop and what hangs off it: memory fitting, EMA, the best epoch, stopping."""
