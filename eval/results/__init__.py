"""Result folders; a folder whose study is the point keeps the command that made it as `run.py`."""
