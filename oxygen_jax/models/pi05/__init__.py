"""π0.5 (openpi layout): config presets, the parameter table, observations, prefill and denoising."""
