"""The user's tools behind the src/*.py scripts: evaluate, predict, prepare, export, plot."""
