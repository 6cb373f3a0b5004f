"""Qwen3.5, the Gated DeltaNet hybrid: `model` (spec, presets, weights, the grouped layer scan, prefill and
step), `layers` (the full-attention and linear layer kinds), `gated_deltanet` (the linear layers' mixer and delta
rule), `steps` (transformers' decode-step sums), `decoder` (the slot pool's `LanguageDecoder` and `mot`'s stack)."""
