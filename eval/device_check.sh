#!/usr/bin/env bash
# The GPU check: the one script a machine with an NVIDIA GPU runs first (docs/development.md).
#
#   bash eval/device_check.sh [--out DIR] [--budget SECONDS] [--tar FILE]    # on a GPU machine
#   bash eval/device_check.sh --smoke [--out DIR]                           # anywhere: CPU, tiny preset
#
# GPU mode: installs the GPU extra (requirements-gpu.txt) into .venv (made from requirements.txt first
# if absent), then, within --budget seconds (default 560: 9 min 20 s), measures π0.5 at full size in
# bfloat16 with random weights, one step after the other, each under its own `timeout`:
#
#   weights   the `pi05` preset's random weights (seed 0) drawn once and saved (our checkpoint format)
#             to a temporary folder; every later step restores them with --ckpt
#   settings  python -m eval.bench: isolated / shared_kv / continuous, LIBERO, S = 10, N = 30, k = 5,
#             20 measured frames, compile time reported apart; its component times (measured first,
#             each alone) include the decode step t(B) at B = 1, 2, 4, 6, 8, 16, 32, 64 ("decode")
#   serve     python -m eval.serving.serve_bench: 1 / 4 / 8 robots, batched against one robot at a time
#   adapter   python -m eval.bench --adapter-rank 16: decode steps and a continuous frame with a
#             language adapter against the base weights
#   speculate python -m eval.bench.repeat: the repeat workload (one LIBERO robot, a memory request every
#             frame repeating its prompt with probability p = 0 / 0.5 / 0.9, N = 20, k = 5), plain
#             continuous batching against speculative decoding at γ = 4 (k verify steps per frame), with
#             one decode step and one verify step measured alone (the verify / decode ratio)
#   train     python -m eval.memory_train_bench: the memory-adapter training step (bf16 base, float32
#             rank-16 adapter, B = 2, Tp = 100, T = 29), compile time apart, then 5 timed steps
#   pi0       python -m oxygen_jax.run --preset pi05, then --preset pi0 (openpi's π0: a state token, the time
#             MLP): the same robot loop (LIBERO, S = 10, k = 5, 20 frames) at full size, frame times side by side
#   roofline  python -m eval.roofline: the GPU's matmul rate and bandwidth measured, each component timed
#             against max(FLOPs / peak, bytes / bandwidth), the datasheet predictions beside (GPU mode only)
#
# Everything goes to one folder (default eval/results/gpu_<UTC date>): one sub-folder per step, its log,
# steps.tsv (step, exit code, seconds, command) and summary.md, one page with the key ratios of each
# step's JSON (`python -m eval.bench.report DIR/settings` makes tables and plots later, on any machine). The
# steps share one fresh persistent compilation cache, so a later step loads the programs an earlier one
# compiled (its compile_s is then a cache load). Exit code 0 when every step exited 0, else 1;
# summary.md is written either way.
#
# Without a GPU (nvidia-smi lists none) the script says so in one line and exits 0, unless --smoke.
# --smoke runs every step on the CPU with the tiny preset and tiny sizes (its numbers measure nothing)
# into --out DIR (default: a new temporary folder); tests/test_device_check.py runs it. The smoke run leaves
# out the speculate step (its compiles would double the test) unless DEVICE_CHECK_SPECULATE=1.
#
# PYTHON=/path/to/python skips the setup and uses that interpreter.
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1

SMOKE=0 OUT_DIR="" BUDGET=560 TAR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT_DIR=${2:?--out needs a folder}; shift ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    --tar) TAR=${2:?--tar needs a file name}; shift ;;
    -h|--help) sed -n '2,40p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$SMOKE" = 0 ] && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "device_check: no GPU on this machine (nvidia-smi lists none): nothing measured; --smoke runs the CPU smoke test."
  exit 0
fi

START=$(date +%s)
if [ -z "$OUT_DIR" ]; then
  if [ "$SMOKE" = 1 ]; then
    OUT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")
  else
    OUT_DIR="eval/results/gpu_$(date -u +%Y%m%d)"
    [ -e "$OUT_DIR" ] && OUT_DIR="${OUT_DIR}_$(date -u +%H%M%S)"
  fi
fi
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
STEPS="$OUT_DIR/steps.tsv"
: > "$STEPS"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/device_check_work.XXXXXX")  # the saved weights (6.7 GB at full size); removed at the end
WEIGHTS="$WORK/weights"
export PYTHONUNBUFFERED=1

# step NAME CAP_SECONDS CMD...: runs CMD under `timeout`, logs to NAME.log, appends to steps.tsv.
# In GPU mode the timeout is min(CAP, what is left of --budget); with under 20 s left the step is skipped.
step() {
  local name=$1 cap=$2; shift 2
  local limit=$cap
  if [ "$SMOKE" = 0 ]; then
    local left=$(( DEADLINE - $(date +%s) ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
      printf '%s\tskipped\t0\t%s\n' "$name" "$*" >> "$STEPS"
      echo "device_check: $name skipped (the ${BUDGET} s budget is spent)"
      return
    fi
  fi
  echo "device_check: $name (at most ${limit} s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  local cmd="$*"  # one line in the table whatever the command holds (a bash -c script may span lines)
  cmd=${cmd//$'\\\n'/ }
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "${cmd//$'\n'/ }" >> "$STEPS"
  echo "device_check: $name exited $rc after $(( $(date +%s) - t0 )) s (log: $OUT_DIR/$name.log)"
}

# --- the interpreter ---------------------------------------------------------------------------------
has_gpu_jax() { "$1" -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 1)' >/dev/null 2>&1; }

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  SETUP_NOTE="PYTHON=$PYTHON given: no setup"
elif [ "$SMOKE" = 1 ]; then
  PY=.venv/bin/python
  [ -x "$PY" ] || PY=python3
  SETUP_NOTE="smoke: no setup"
else
  {
    if [ ! -x .venv/bin/python ]; then
      python3 -m venv .venv && timeout 600 .venv/bin/pip install -q --retries 0 --timeout 10 -r requirements.txt
      venv_rc=$?
      if [ "$venv_rc" != 0 ]; then echo "making .venv failed ($venv_rc): removing it"; rm -rf .venv; fi
    fi
    if [ -x .venv/bin/python ]; then
      timeout 600 .venv/bin/pip install -q --retries 0 --timeout 10 -r requirements-gpu.txt
      echo "pip install -r requirements-gpu.txt exited $?"
    fi
  } > "$OUT_DIR/setup.log" 2>&1
  if [ -x .venv/bin/python ] && has_gpu_jax .venv/bin/python; then
    PY=.venv/bin/python
    SETUP_NOTE="requirements-gpu.txt installed into .venv"
  elif has_gpu_jax python3; then
    # No package index reachable (an isolated machine): the machine's own JAX, if it sees the GPU.
    PY=$(command -v python3)
    SETUP_NOTE="pip could not install requirements-gpu.txt (setup.log); using $PY, whose JAX sees the GPU"
  else
    PY=""
    SETUP_NOTE="no interpreter with a GPU-enabled JAX (setup.log)"
  fi
  # Wheels a machine without a package index lacks (e.g. websockets for the server) can be carried in .whl/.
  if [ -n "$PY" ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" .whl/*.whl >> "$OUT_DIR/setup.log" 2>&1 \
      && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" && SETUP_NOTE="$SETUP_NOTE; wheels from .whl/"
  fi
  printf 'setup\t%s\t%s\t%s\n' "$([ -n "$PY" ] && echo 0 || echo 1)" "$(( $(date +%s) - START ))" \
    "pip install -r requirements-gpu.txt ($SETUP_NOTE)" >> "$STEPS"
fi
echo "device_check: python $PY ($SETUP_NOTE); results in $OUT_DIR"

# --- the steps ---------------------------------------------------------------------------------------
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  # The project's compile cache (the one run and serve use), so a rerun of the smoke test loads its programs.
  CACHE=${OXYGEN_JAX_CACHE_DIR:-$HOME/.cache/oxygen_jax/xla}
  PRESET=tiny DTYPE=float32
  BENCH=(--S 1 --N 2 --frames 1 --warmup 0 --component-repeats 1)
  SETTINGS=(--k 1 --component-batches 1,2)
  ADAPTER=(--k 1 --adapter-rank 2 --component-batches 1)
  SERVE=(--robots 1 2 --frames 2 --warmup-frames 1 --repeats 1 --steps 1 --max-tokens 2 --tokens-per-frame 1 --slots 2)
  TRAIN=(--rank 2 --batch-size 1 --cameras 2 --prompt-len 8 --suffix-len 8 --steps 2)
  SPECULATE=(--p 0.9 --frames 1 --warmup 0 --N 2 --k 1 --S 1 --spec 1)
  CAP_WEIGHTS=120 CAP_SETTINGS=120 CAP_SERVE=120 CAP_ADAPTER=120 CAP_TRAIN=120 CAP_SPECULATE=120
else
  CACHE="$WORK/xla"  # fresh: the first compile of each program is a real one
  PRESET=pi05 DTYPE=bfloat16
  BENCH=(--S 10 --N 30)
  SETTINGS=(--k 5 --frames 20 --component-batches 1,2,4,6,8,16,32,64)  # 6: the batch continuous runs at N/k
  ADAPTER=(--k 5 --frames 10 --adapter-rank 16 --component-batches 1,6,64)
  SERVE=(--robots 1 4 8 --frames 10 --warmup-frames 2 --repeats 1)
  TRAIN=(--rank 16 --batch-size 2 --cameras 3 --prompt-len 100 --suffix-len 29 --steps 5)  # OxyGen's recipe shapes
  SPECULATE=(--p 0 0.5 0.9 --frames 20 --N 20 --k 5 --S 10 --spec 4)  # the CPU run's workload (docs/benchmarks.md)
  CAP_WEIGHTS=100 CAP_SETTINGS=190 CAP_SERVE=130 CAP_ADAPTER=60 CAP_TRAIN=100 CAP_SPECULATE=120
fi
DEADLINE=$(( $(date +%s) + BUDGET ))
export JAX_COMPILATION_CACHE_DIR="$CACHE" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

if [ -n "$PY" ]; then
  step weights "$CAP_WEIGHTS" "$PY" -c "import sys; from oxygen_jax import init_params, model_config, save_params; \
save_params(sys.argv[1], init_params(model_config(sys.argv[2], dtype=sys.argv[3]), 0))" "$WEIGHTS" "$PRESET" "$DTYPE"
  MODEL=(--ckpt "$WEIGHTS")
  [ -d "$WEIGHTS" ] || MODEL=(--preset "$PRESET")  # no saved weights: every step draws the same ones itself
  BENCH=(-m eval.bench "${MODEL[@]}" --dtype "$DTYPE" --workloads libero --no-progress "${BENCH[@]}")
  SERVE=(-m eval.serving.serve_bench "${MODEL[@]}" --dtype "$DTYPE" "${SERVE[@]}")
  serve_step() {
    # Two servers (batched, serial) share the GPU: neither may preallocate most of its memory.
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 step serve "$CAP_SERVE" "$PY" "${SERVE[@]}" \
      --compile-cache "$CACHE" --startup-timeout "$CAP_SERVE" --out "$OUT_DIR/serve"
  }
  if [ "$SMOKE" = 1 ]; then serve_step & SERVE_PID=$!; fi  # smoke: the server runs beside the bench steps
  step settings "$CAP_SETTINGS" "$PY" "${BENCH[@]}" "${SETTINGS[@]}" --settings isolated shared_kv continuous \
    --out "$OUT_DIR/settings"
  if [ "$SMOKE" = 1 ]; then wait "$SERVE_PID"; else serve_step; fi
  step adapter "$CAP_ADAPTER" "$PY" "${BENCH[@]}" "${ADAPTER[@]}" --settings continuous --out "$OUT_DIR/adapter"
  if [ "$SMOKE" = 0 ] || [ "${DEVICE_CHECK_SPECULATE:-0}" = 1 ]; then
    SPEC_MODEL=(--preset "$PRESET")
    [ -d "$WEIGHTS" ] && SPEC_MODEL=(--ckpt "$WEIGHTS")
    step speculate "$CAP_SPECULATE" "$PY" -m eval.bench.repeat "${SPEC_MODEL[@]}" --dtype "$DTYPE" "${SPECULATE[@]}" \
      --out "$OUT_DIR/speculate"
  fi
  step train "$CAP_TRAIN" "$PY" -m eval.memory_train_bench "${MODEL[@]}" --dtype "$DTYPE" "${TRAIN[@]}" \
    --out "$OUT_DIR/train"
  # π0 beside π0.5: the same robot loop, each variant compiled in its own process (frame ms median in pi0.log).
  # Smoke runs leave it out unless DEVICE_CHECK_PI0=1 (two more compiles).
  if [ "$SMOKE" = 1 ]; then PI_SIZES=(--frames 1 --steps 1 --slots 1 --max-new-tokens 2); PI=(tiny pi0_tiny); CAP_PI=120
  else PI_SIZES=(--frames 20 --steps 10 --slots 8 --tokens-per-frame 5); PI=(pi05 pi0); CAP_PI=150; fi
  if [ "$SMOKE" = 0 ] || [ "${DEVICE_CHECK_PI0:-0}" = 1 ]; then
    step pi0 "$CAP_PI" bash -c 'for p in "${@:4}"; do echo "== --preset $p"; "$1" -m oxygen_jax.run --preset "$p" \
--dtype "$2" --no-cache $3 || exit $?; done' _ "$PY" "$DTYPE" "${PI_SIZES[*]}" "${PI[@]}"
  fi
  if [ "$SMOKE" = 0 ]; then  # each component against this GPU's measured peaks, and the datasheet predictions
    step roofline 150 "$PY" -m eval.roofline "${MODEL[@]}" --dtype "$DTYPE" --out "$OUT_DIR/roofline"
  fi
fi

# quant (issue 43): the saved weights quantized to int8 and to fp8 (python -m oxygen_jax.quantize, all layer
# weights), each run by eval.bench in the model dtype (continuous, LIBERO, the settings step's sizes; components:
# prefix pass, denoise, decode step at B = 1, 6, 64), set beside the settings step's run in summary.md. Then
# matmul_int8 / matmul_fp8: the same quantized weights dequantized (float), weight-only and, where the device has
# the product (nn.quant.native_dots: fp8 from compute capability 8.9), int8 x int8 / fp8 x fp8 on activations
# quantized per row, side by side in one process (python -m eval.quant_matmul: prefix pass, action chunk, decode
# step at B = 1, 64). Smoke runs leave them out unless DEVICE_CHECK_QUANT=1 (more compiles).
if [ "$SMOKE" = 1 ]; then
  QUANT_SIZES=(--S 1 --N 2 --k 1 --frames 1 --warmup 0 --component-repeats 1 --component-batches 1)
  MATMUL_SIZES=(--batches 1 --repeats 1)
else
  QUANT_SIZES=(--S 10 --N 30 --k 5 --frames 20 --component-batches 1,6,64)
  MATMUL_SIZES=(--batches 1 64 --repeats 10)
fi
if [ -n "$PY" ] && [ -d "$WEIGHTS" ] && { [ "$SMOKE" = 0 ] || [ "${DEVICE_CHECK_QUANT:-0}" = 1 ]; }; then
  for QW in int8 fp8; do
    step "quant_$QW" 150 bash -c '"$1" -m oxygen_jax.quantize --ckpt "$2" --out "$3" --weights "$4" && "$1" -m eval.bench \
--ckpt "$3" --dtype "$5" --workloads libero --no-progress --settings continuous "${@:7}" --out "$6"' _ "$PY" "$WEIGHTS" \
      "$WORK/weights_$QW" "$QW" "$DTYPE" "$OUT_DIR/quant_$QW" "${QUANT_SIZES[@]}"
    [ -d "$WORK/weights_$QW" ] && step "matmul_$QW" 150 "$PY" -m eval.quant_matmul --ckpt "$WORK/weights_$QW" \
      --dtype "$DTYPE" "${MATMUL_SIZES[@]}" --out "$OUT_DIR/matmul_$QW"
  done
fi

# π0-FAST (issue 40): a full-size random π0-FAST, N = 1, 4, 8 robots: per-robot token streams in one decode pool with
# language beside, against openpi's lockstep rule (python -m eval.bench.fast, the same frames and weights).
# Smoke runs leave it out unless DEVICE_CHECK_FAST=1 (three more compiles).
if [ "$SMOKE" = 1 ]; then
  FAST_SIZES=(--robots 1 --frames 1 --min-tokens 4 --max-tokens 8 --k 4 --language 1 --language-tokens 4); CAP_FAST=300
else
  FAST_SIZES=(--size full --robots 1 4 8 --frames 4 --min-tokens 32 --max-tokens 128 --k 8); CAP_FAST=240
fi
if [ -n "$PY" ] && { [ "$SMOKE" = 0 ] || [ "${DEVICE_CHECK_FAST:-0}" = 1 ]; }; then
  step fast "$CAP_FAST" "$PY" -m eval.bench.fast "${FAST_SIZES[@]}" --out "$OUT_DIR/fast"
fi

# --- the one-page summary ----------------------------------------------------------------------------
GPU_LINE=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
"${PY:-python3}" - "$OUT_DIR" "$SMOKE" "$(( $(date +%s) - START ))" "$BUDGET" "${GPU_LINE:-none}" "$PY" "$PRESET" \
  "$DTYPE" <<'EOF'
import datetime, json, sys
from pathlib import Path

out, smoke, total_s, budget, gpu, py, preset, dtype = Path(sys.argv[1]), sys.argv[2] == "1", *sys.argv[3:9]
ORDER = ["setup", "weights", "settings", "decode", "serve", "adapter", "speculate", "train", "pi0", "roofline"]
WHAT = {
    "setup": "GPU extra installed, interpreter chosen",
    "weights": "random weights (seed 0) drawn once and saved",
    "settings": "isolated / shared_kv / continuous side by side",
    "decode": "one decode step t(B) against batch B (in the settings run)",
    "serve": "R robots on one server, batched vs one at a time",
    "adapter": "language adapter against the base weights",
    "speculate": "repeat workload: speculative decoding against continuous batching",
    "train": "memory-adapter training step (base in the model dtype, float32 adapter)",
    "pi0": "π0.5 and π0 robot loops at the preset's size (frame ms medians in pi0.log)",
    "roofline": "each component against measured peaks (roofline/report.md), predictions",
}
steps = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs, cmd = line.split("\t", 3)
    steps[name] = (rc, secs, cmd)
if "settings" in steps:  # the decode step times are the settings run's components, measured before its frames
    have = (out / "settings" / "components.json").is_file()
    steps["decode"] = ("0" if have else steps["settings"][0], "–", "(the settings run's components.json)")


def load(path):
    try:
        return json.loads((out / path).read_text())
    except (OSError, ValueError):
        return None


def f(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


env = load("settings/environment.json") or load("adapter/environment.json") or {}
now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
lines = ["# Device check" + (" (smoke: CPU, tiny preset; the numbers measure nothing)" if smoke else ""), ""]
lines += [f"- when: {env.get('timestamp', now)} (UTC); commit `{env.get('commit', '–')}`",
          f"- GPU (nvidia-smi): {gpu}; JAX {env.get('jax', '–')} on {env.get('backend', '–')} "
          f"({env.get('device_kind', '–')}); python `{py or '–'}`",
          f"- model: the `{preset}` preset in {dtype}, random weights (seed 0) saved once and restored by every step; "
          f"total {total_s} s" + ("" if smoke else f", measurement budget {budget} s"), ""]
lines += ["| step | what | exit code | seconds |", "|---|---|---|---|"]
for name in ORDER:
    if name in steps:
        lines.append(f"| {name} | {WHAT[name]} | {steps[name][0]} | {steps[name][1]} |")
lines.append("")

s = load("settings/summary.json")
if s:
    by = {r["setting"]: r for r in s}
    r0 = s[0]
    lines += [f"## settings (LIBERO, S = {r0['S']}, N = {r0['N']}, k = {by.get('continuous', {}).get('k')}, "
              f"{r0.get('frames_measured')} measured frames)", "",
              "| setting | frame p50 ms | action Hz | tokens/s | speedup vs isolated | ideal speedup | compile s |",
              "|---|---|---|---|---|---|---|"]
    for r in s:
        lines.append(f"| {r['setting']} | {f(r['frame_ms_median'])} | {f(r['action_hz'])} | {f(r['tokens_per_s'])} "
                     f"| {f(r['speedup_vs_isolated'], '.2f')} | {f(r['ideal_speedup'], '.2f')} | {f(r['compile_s'])} |")
    lines += ["", f"Recompiles after warm-up: {max(r.get('recompiles_after_warmup', 0) for r in s)}.", ""]

d = load("settings/components.json")
if d:
    t = {int(b): v for b, v in next(iter(d.values()))["decode_step_ms"].items()}
    bs = sorted(t)
    lines += ["## decode step", "", "| B | " + " | ".join(map(str, bs)) + " |", "|---" * (len(bs) + 1) + "|",
              "| t(B) ms | " + " | ".join(f(t[b], ".2f") for b in bs) + " |",
              "| t(B) / t(1) | " + " | ".join(f(t[b] / t[bs[0]], ".2f") for b in bs) + " |",
              "| tokens/s, B / t(B) | " + " | ".join(f(1e3 * b / t[b], ".0f") for b in bs) + " |", ""]

v = load("serve/summary.json")
if v:
    lines += ["## serving", "", "| mode | robots | actions/s, all robots | batched / one at a time | of ideal "
              "| RTT p50 ms | step p50 ms |", "|---|---|---|---|---|---|---|"]
    for r in v["records"]:
        frac = r.get("fraction_of_ideal")
        lines.append(f"| {r['mode']} | {r['robots']} | {f(r['action_rate_total'])} | "
                     f"{f(r.get('speedup_vs_serial'), '.2f') if r['mode'] == 'batched' else ''} | "
                     f"{f(None if frac is None else 100 * frac, '.0f')} % | {f(r['rtt_p50_ms'])} | {f(r['step_p50_ms'])} |")
    lines += ["", f"Server start-up to healthy, s: {v['environment'].get('startup_s')}.", ""]

a, ac = load("adapter/summary.json"), load("adapter/components.json")
if ac:
    c = next(iter(ac.values()))
    base = {int(b): x for b, x in c["decode_step_ms"].items()}
    bs = sorted(base)
    row = lambda key: " | ".join(f(c[key][str(b)] / base[b], ".2f") if c.get(key) else "–" for b in bs)  # noqa: E731
    lines += ["## adapter overhead", "", "| decode batch B | " + " | ".join(map(str, bs)) + " |",
              "|---" * (len(bs) + 1) + "|", "| base step ms | " + " | ".join(f(base[b], ".2f") for b in bs) + " |",
              f"| every row on the adapter / base | {row('adapter_step_ms')} |",
              f"| half the rows on the adapter / base | {row('mixed_step_ms')} |", ""]
    if a:
        frames = {r["adapter_share"]: r["frame_ms_median"] for r in a}
        if 0.0 in frames and len(frames) > 1:
            share = max(frames)
            lines += [f"Continuous frame with {share:.0%} of the requests on the adapter / without a bank: "
                      f"{f(frames[share], '.1f')} / {f(frames[0.0], '.1f')} ms = {frames[share] / frames[0.0]:.3f}.", ""]

t = load("train/summary.json")
if t:
    lines += ["## memory-adapter training step", "",
              f"{t['model']} in {t['dtype']}, float32 rank-{t['rank']} adapter ({t['trainable_params']:,} parameters), "
              f"B = {t['batch_size']}, {t['cameras']} cameras, Tp = {t['prompt_len']}, T = {t['suffix_len']}.", "",
              "| load s | compile s | first run s | step ms, median | steps | peak GiB | losses finite |",
              "|---|---|---|---|---|---|---|",
              f"| {f(t['load_s'])} | {f(t['compile_s'])} | {f(t['first_run_s'], '.2f')} | {f(t['step_ms_median'])} | "
              f"{len(t['step_ms'])} | {f(None if t.get('peak_bytes') is None else t['peak_bytes'] / 2**30, '.1f')} | "
              f"{t['finite']} |", ""]

r = load("speculate/repeat.json")
if r:
    c = r["components"]
    ratios = ", ".join(f"γ = {k.rsplit('g', 1)[1]}: {v / c['decode_step_ms']:.2f}" for k, v in c.items()
                       if k.startswith("verify_step_ms_g"))
    lines += [f"## speculative decoding (repeat workload, N = {r['N']}, k = {r['k']})", "",
              f"One decode step {f(c['decode_step_ms'], '.2f')} ms; verify step / decode step: {ratios}. "
              f"Same tokens in every setting: {all(x['same_tokens'] for x in r['results'])}.", "",
              "| p | setting | frame p50 ms | action Hz | tokens/s | latency (frames) | tokens per step |",
              "|---|---|---|---|---|---|---|"]
    for res in r["results"]:
        for name in ["plain", *r["specs"]]:
            x = res[name]
            lines.append(f"| {res['p']:g} | {name} | {f(x['frame_ms_median'])} | {f(x['action_hz'])} | "
                         f"{f(x['tokens_per_s'])} | {f(x['latency_frames_mean'], '.2f')} | {f(x['tokens_per_step'], '.2f')} |")
    lines.append("")

lines += ["## commands", ""] + [f"- {n}: `{steps[n][2]}`" for n in ORDER if n in steps and n != "decode"]
(out / "summary.md").write_text("\n".join(lines) + "\n")
EOF
# The quant steps' section: their continuous frame and components against the settings step's (same dtype).
if compgen -G "$OUT_DIR/quant_*/summary.json" > /dev/null; then
  "${PY:-python3}" - "$OUT_DIR" <<'QEOF' >> "$OUT_DIR/summary.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(path):
    try:
        return json.loads((out / path).read_text())
    except (OSError, ValueError):
        return None


def row(name, run, comp):
    cont = next((r for r in run or [] if r["setting"] == "continuous"), {})
    c = next(iter((comp or {}).values()), {})
    dec = c.get("decode_step_ms", {})
    return [name, cont.get("frame_ms_median"), cont.get("action_hz"), c.get("prefill_ms"),
            next(iter(c.get("denoise_ms", {}).values()), None), dec.get("1"), dec.get("6"), dec.get("64")]


rows = [row("model dtype (settings step)", load("settings/summary.json"), load("settings/components.json"))]
rows += [row(q.name.removeprefix("quant_"), load(f"{q.name}/summary.json"), load(f"{q.name}/components.json"))
         for q in sorted(out.glob("quant_*")) if q.is_dir()]
f = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
print("## quantized weights (python -m oxygen_jax.quantize, all layer weights)\n")
print("| weights | continuous frame p50 ms | action Hz | prefix pass ms | denoise ms | decode B=1 ms | B=6 | B=64 |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join([r[0]] + [f(x) for x in r[1:]]) + " |")
for r in rows[1:]:
    ratios = [f"{r[i] / rows[0][i]:.2f}" if r[i] and rows[0][i] else "–" for i in (1, 3, 4, 5, 7)]
    print(f"\n{r[0]} / model dtype: frame {ratios[0]}, prefix pass {ratios[1]}, denoise {ratios[2]}, "
          f"decode B=1 {ratios[3]}, B=64 {ratios[4]}.")
print()
QEOF
fi
for MM in "$OUT_DIR"/matmul_*/report.md; do  # the matmul modes' tables, as eval.quant_matmul wrote them
  [ -f "$MM" ] && { sed 's/^# /## /' "$MM"; echo; } >> "$OUT_DIR/summary.md"
done
echo "device_check: summary in $OUT_DIR/summary.md"

if [ -n "$TAR" ]; then tar -czf "$TAR" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"; fi
rm -rf "$WORK"
awk -F'\t' '$2 != "0" { bad = 1 } END { exit bad }' "$STEPS"
