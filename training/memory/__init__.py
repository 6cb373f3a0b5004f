"""Suffix-only language LoRA (textual memory) and base pre-training on a text task, with optax.

    python -m training.memory --mode base --preset demo --train-tokenizer 512 --data DS --out B  # "Scene: "
    python -m training.memory --base B/base --data DS --out A       # then the "Memory: " adapter on top
    python -m training.memory export-demo --base B/base --adapter A/adapter --data DS   # checkpoints/demo

(the exact commands of the shipped demo are in checkpoints/demo/README.md).

Axes (`oxygen_jax.axes`): B batch rows, T suffix tokens (request prompt ‖ answer ‖ EOS ‖ padding), P prefix
tokens, V vocabulary, L layers, E stored adapters (1 here: adapter id 1; id 0 = base weights).

One loss, one forward, the serving path:

    [ prefix: cameras + task prompt | "Memory: " | answer + EOS | pad ]
      model.prefill                   LanguageDecoder.suffix_forward (causal, teacher-forced): the slot pool's
                                      request-prompt pass, with the LoRA bank and per-row adapter ids

cross-entropy on the answer tokens only (`MemoryBatch.loss_mask`; the logits at suffix position j predict
token j + 1), logits through the same final norm and tied head as admission (`model.suffix_logits`).

Two modes:

* `adapter`: a LoRA bank (`pi05.lora.init_bank`, B = 0, so step 0 is exactly the base model) is the only thing
  differentiated and updated. The prefix cache is computed before `jax.grad` (and stop-gradient'ed) and the
  base parameters are a plain, non-differentiated argument of the step: they cannot change.
* `base`: full fine-tune of the VLM expert, SigLIP and the token embedding on a text task through the same
  suffix path (prefix inside the gradient), e.g. "Scene: ..." descriptions standing in for a VLM's
  pretraining. The action expert and the action/time projections are not in the optimised tree.

Optimisation: optax AdamW after global-norm clipping, warm-up + cosine schedule (`training.flow.train_step`'s
`make_optimizer`). Data: `training.data.frames` frames; the batch of step s is a pure function of (seed, s)
(`epoch_batches`), so a resumed run sees exactly the batches an uninterrupted one would. State (step,
trainable leaves, optimizer state) is saved by an orbax `CheckpointManager` with a SHA-256 per leaf; resuming
verifies them, falls back past damaged steps and is bit-identical. A step whose loss, gradient norm or state is
not finite stops the run: nothing is evaluated, checkpointed or saved from it.
Data parallelism: the batch is sharded over the `data` axis of a `jax.sharding.Mesh`, parameters, bank and
optimizer state are replicated (`model.make_mesh`), or leaves above `--fsdp-min-size` elements are sharded (FSDP).
Several processes (hosts) train one run (`training.distributed`, docs/multihost.md; measured on CPU with gloo
only, never on GPUs):

    for i in 0 1; do python -m training.memory --base B/base --data DS --out A --coordinator localhost:12345 \\
        --num-processes 2 --process-id $i & done; wait
    srun python -m training.memory --base B/base --data DS --out A      # SLURM / Open MPI: detected

Each process decodes only its rows of every batch; process 0 alone writes files, logs and the adapter or base;
every process writes its shards of the checkpoints, which resume on any process count; the evaluation's
batches are split over the processes; `--fixed-order-reduction` makes the gradient sum bit-identical across
process layouts; `--heartbeat-timeout` bounds how long the others run after one process dies.

Held-out evaluation decodes greedily through the real slot pool (`oxygen_jax.runtime.engine.Engine`, one frame per
batch), not by teacher forcing.

A trained adapter is saved as an orbax item of openpi-named LoRA leaves plus `adapter.json` (name, rank,
alpha, targets, prompt, base checkpoint and its fingerprint, per-leaf SHA-256): `oxygen_jax.ckpts.adapters`
(`save_adapter`, `load_adapter`, `load_bank`: what an engine needs, `Engine(params, cfg, tok, bank=bank,
adapter_names=names)`). The embedded demo folder is read by `oxygen_jax.demo.load_demo`.

Modules, in the order a run uses them:

    config        TrainConfig, the model presets (`preset_config`, `demo_model_config`)
    data          TextTask, StepBatches (the batch of each step), augment_frame, fixed_batches
    model         trainable trees and state, suffix_logits / answer_loss, the compiled step, the mesh
    evaluate      engine_answers, greedy_exact_match (through `Engine`)
    checkpoints   StateCheckpoints: verified training-state checkpoints, resume with fallback
    loop          train (stops at the first non-finite step: NonFiniteStepError)
    export_demo   the embedded demo folder
    __main__      the command line
"""
