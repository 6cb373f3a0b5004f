#!/usr/bin/env bash
# OxyGen's LIBERO textual-memory recipe on an openpi π0.5 base, in one command (docs/memory_lora.md §7):
#
#   bash training/data/oxygen_libero/recipe.sh PI05_LIBERO PALIGEMMA_TOKENIZER ANNOTATIONS LIBERO_HDF5 OUT
#
#   PI05_LIBERO          openpi's pi05_libero checkpoint (gs://openpi-assets/checkpoints/pi05_libero)
#   PALIGEMMA_TOKENIZER  paligemma_tokenizer.model (gs://big_vision/paligemma_tokenizer.model)
#   ANNOTATIONS          the released annotations' dataset/annotations (<suite>/<task>/demo_<k>.jsonl)
#   LIBERO_HDF5          LIBERO's raw demonstrations (<suite>/<task>_demo.hdf5 for the four suites)
#   OUT                  output folder: OUT/train (adapter, checkpoints, metrics), OUT/eval (report)
#
# Trains their adapter (rank 16, alpha 16, all five targets, AdamW b1 0.9 b2 0.95, no weight decay, clip 1,
# peak 1e-4 after 100 warm-up steps, cosine to 1e-5 at step 1,500, batch 2, seed 7, "Memory: " seed, 28 suffix
# inputs = T 29, prompt 100 tokens, bf16 base) on their split with their task/target-balanced batches, then
# reports their metric on their 400 evaluation frames. Set OXYGEN_ADAPTER=DIR (their released folder) to
# evaluate their adapter the same way (OUT/eval_oxygen). Rerunning resumes from OUT/train/checkpoints.
# Environment overrides (for a quick try on small data): STEPS, SUFFIX_LEN, PROMPT_LEN, EVAL_EVERY, PYTHON.
set -euo pipefail
if [ "$#" -ne 5 ]; then
  sed -n '4,10p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
BASE=$1 TOKENIZER=$2 ANN=$3 HDF5=$4 OUT=$5
PY=${PYTHON:-.venv/bin/python}
PROMPT_LEN=${PROMPT_LEN:-100}
common=(--base "$BASE" --base-dtype bfloat16 --tokenizer "$TOKENIZER" --prompt-len "$PROMPT_LEN"
        --data "$ANN" --libero-hdf5 "$HDF5")
"$PY" -m training.memory "${common[@]}" --out "$OUT/train" --steps "${STEPS:-1500}" --batch-size 2 \
  --rank 16 --alpha 16 --lr 1e-4 --final-lr 1e-5 --warmup 100 --weight-decay 0 --clip-norm 1 \
  --suffix-len "${SUFFIX_LEN:-29}" --seed 7 --eval-every "${EVAL_EVERY:-250}" --checkpoint-every 250 --no-progress
"$PY" -m eval.memory_eval "${common[@]}" --adapter "$OUT/train/adapter" --out "$OUT/eval"
if [ -n "${OXYGEN_ADAPTER:-}" ]; then
  "$PY" -m eval.memory_eval "${common[@]}" --adapter "$OXYGEN_ADAPTER" --out "$OUT/eval_oxygen"
fi
