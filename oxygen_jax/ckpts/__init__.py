"""Floor 3: checkpoint formats: openpi, our own orbax checkpoints, Hugging Face safetensors, adapter files."""
