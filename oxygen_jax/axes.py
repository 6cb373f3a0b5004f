"""The package's axis letters: one glossary, used by every module docstring, shape comment and einsum.

Each letter means one thing everywhere. Counts that are not array axes are written as words
(`num_steps` denoise steps, `tokens_per_frame` k, `rank` r of a LoRA adapter).

Model
    B    batch rows: observations in one prefill (robots), or requests in a forward pass
    L    layers of a stack
    T    query tokens of one forward pass
    S    key tokens an attention reads (prefix cache ‖ own tokens)
    D    width of the VLM expert (Da: action expert; W: SigLIP)
    F    MLP hidden size (Fv: SigLIP)
    N    query heads (Nv: SigLIP)
    K    key/value heads
    R    query heads per KV head, N / K (grouped-query attention)
    H    head dim (Hv: SigLIP)
    V    vocabulary
    Dc   width of the adaRMS time condition

Observations and actions
    Nc   cameras present in the prefix (a robot's real camera slots)
    Np   image tokens per camera (patches)
    Px   image side in pixels; p: patch side
    Tp   prompt tokens in the prefix
    P    prefix tokens, Nc * Np + Tp
    Ha   actions per chunk (action horizon)
    Ad   padded model action / state dim (32); Ds, Da: a robot's native state / action dims

Language decoding and schedules
    Ns   decode slots in the pool
    Q    request-prompt capacity of a slot
    M    max new tokens per request
    C    slot length, P + Q + M
    J    requests offered in one admission call (per frame)
    Fr   frames of a compiled rollout
    Rq   requests in a rollout's request table
    E    stored language adapters in a LoRA bank (adapter id 0 = base weights, not stored)
    Y    rows flattened over batch and tokens, B * T (what the feed-forward layers see)

Other backbones (Qwen3-VL)
    Mr   M-RoPE position axes (3: time, height, width)
    Ed   DeepStack layers (ViT features added to the first Ed LLM layers)
    Mw   ViT patches merged into one LLM token, m * m (m: spatial merge size)
    Ni   LLM image tokens, Np / Mw

In einsum strings, a stacked pair (K/V, gate/up) is written `2` and q/k/v `3`. A module with axes
of its own (the action heads of `models.heads`; image height and width Hi, Wi of other datasets in
`training.data.frames`) lists them in its docstring and never reuses a letter of this glossary for
another meaning.
"""
