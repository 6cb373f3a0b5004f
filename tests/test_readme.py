"""The README's real-checkpoint example runs as written (on the tiny openpi fixture, with the demo tokenizer)."""

from __future__ import annotations

import re

import numpy as np

from helpers import REPO, openpi_fixture


def test_readme_raw_data_example_runs_on_an_openpi_checkpoint():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### From a robot's raw data"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    ckpt_line = 'CKPT = "checkpoints/pi05_libero"'
    tok_line = 'tokenizer = Tokenizer.from_file("checkpoints/paligemma_tokenizer.model")'
    assert ckpt_line in code and tok_line in code  # the two lines a user edits
    code = code.replace(ckpt_line, f'CKPT = {str(openpi_fixture())!r}').replace(
        tok_line, "from oxygen_jax.robots.tokenizer import train_demo_tokenizer; tokenizer = train_demo_tokenizer()")
    code = code.replace("print(", "_printed = (")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the documented example itself
    assert scope["actions"].shape == (1, 10, 7) and np.isfinite(scope["actions"]).all()
    assert scope["request"] in scope["texts"] and isinstance(scope["texts"][scope["request"]], str)
