"""Floor 3: checkpoint formats, and the one loader every command uses.

`orbax_io` (hardened orbax reads, `CheckpointError`) under `openpi` (config inference, restore, norm
stats), `own` (our checkpoints with checksums) and `manifest`; `safetensors` under `hf` (Qwen3 /
Qwen3-VL); adapter files; `load.load_model` reads any of them, or a preset, for run, serve and bench.
"""
