"""π0.5 (openpi layout): config presets, the parameter table, its two experts as backbone specs, observations,
prefill and denoising, and its two-expert LoRA adapters."""
