"""Numerical parity with reference implementations: `checks` (rows, tolerances, the table), `openpi` (π0.5 against
openpi and OxyGen's text decoding), `hf` (Qwen3 / Qwen3-VL against Hugging Face); `python -m eval.parity` picks one."""
