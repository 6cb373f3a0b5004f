"""The LeRobot reading study: `run.py` made this folder's results."""
