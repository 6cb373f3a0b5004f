# python -m eval.parity FIXTURE --quantized QDIR on every fixture oxygen_jax.quantize reads, int8 and fp8 (all layer weights),
# weight-only products and the ones run / serve pick by default (auto).
# FIXTURES=<fixtures folder> bash eval/results/parity_quantized/run.sh > report.txt
cd "$(dirname "$0")/../../.."
F=${FIXTURES:?set FIXTURES to the fixtures folder}
for w in int8 fp8; do
for f in openpi_tiny_pi05 openpi_tiny_pi0 openpi_tiny_pi05_lora lerobot_tiny_pi05 lerobot_tiny_pi0; do
  src=$F/$f; extra=""
  [ -d $src/params ] && src=$src/params
  case $f in lerobot*) extra="--vision-heads $(.venv/bin/python -c "from eval.parity.lerobot_policy import vision_heads_of; from pathlib import Path; print(vision_heads_of(Path('$F/$f')))")";; esac
  .venv/bin/python -m oxygen_jax.quantize --ckpt $src --out ${OUT:-/tmp/parity_quantized}/$f-$w --weights $w $extra --overwrite > /dev/null 2>&1 || echo "quantize failed $f $w"
  for m in weight_only auto; do  # auto: the products run / serve pick on this device
    echo "### $f, $w, --quant-matmul $m"
    .venv/bin/python -m eval.parity $F/$f --quantized ${OUT:-/tmp/parity_quantized}/$f-$w --quant-matmul $m 2>/dev/null
    echo
  done
done; done
