"""The cost of real-time chunking per frame: `run.py` made this folder's results."""
