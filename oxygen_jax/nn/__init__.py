"""Floor 0: model-free building blocks (masks, token sampling, parameter leaves, LayerNorm / RoPE / attention,
the layer loop). Imports no other floor."""
