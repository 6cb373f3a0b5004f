"""The qwen35_precision study: `run.py` made this folder's results."""
