"""Training utilities (flow-matching fine-tuning today; the textual-memory LoRA comes later)."""
