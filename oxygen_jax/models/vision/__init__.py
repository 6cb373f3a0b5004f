"""Vision encoders: `siglip` (π0.5's SigLIP), `siglip_prefix` (SigLIP cameras + prompt as one prefix pass) and
`qwen3_vl` (Qwen3-VL's ViT with its mergers, DeepStack and M-RoPE positions)."""
