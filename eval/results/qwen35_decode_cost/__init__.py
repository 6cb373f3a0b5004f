"""The qwen35_decode_cost study: `run.py` made this folder's results."""
