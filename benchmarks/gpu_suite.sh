#!/usr/bin/env bash
# The GPU checks in one go (for a GPU machine): the GPU tests, the quickstart on CUDA, and every benchmark, each
# under a hard time limit, logs and CSV rows written to OUTDIR (default: benchmarks/results/run-<date>).
#
#   bash benchmarks/gpu_suite.sh [OUTDIR] [STEPS...]
#   STEPS: any of tests quickstart flce attention tma fused core delayed recompute delayed_8b memory_8b memory_8b_64k
#          memory_3b_nvme memory_3b_nvme_masters memory_32b_lora nvme_io
#
# The package must be importable as lightning_slide (pip install -e ., or PYTHONPATH). Every step is killed at its
# limit (a stuck Triton compile ignores SIGTERM), and pytest dumps all thread stacks of a test that hangs.
set -u
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-benchmarks/results/run-$(date +%F)}")
shift || true
steps=("${@:-tests quickstart flce attention tma fused core delayed recompute delayed_8b memory_8b memory_8b_64k memory_3b_nvme memory_3b_nvme_masters memory_32b_lora nvme_io}")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  [[ " ${steps[*]} " == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s)"
  timeout -s KILL "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc; last lines:" && tail -n 3 "$out/$name.log"
  [[ $rc == 0 ]] || status=1
}

hang=()  # with pytest-timeout, a hanging test dumps every thread's stack instead of eating the limit
python -c "import pytest_timeout" 2>/dev/null && hang=(--timeout=120 -o timeout_method=thread)
step tests 420 python -P -m pytest -m gpu -q -p no:cacheprovider -rfE "${hang[@]}"
step quickstart 180 python -P -m lightning_slide fit --config recipes/quickstart.yaml --trainer.precision bf16-mixed \
  --trainer.default_root_dir "$out/quickstart" --trainer.enable_progress_bar false
cd benchmarks
step flce 150 python bench_flce.py --out "$out/flce.csv"
step attention 150 python bench_attention.py --out "$out/attention.csv"
# the kernels' loop tiles by TMA descriptors against pointer loads (Tuning.tma), side by side in one process
step tma 300 python bench_attention_ab.py ../kernels/attention.py ../kernels/attention.py --tune-new tma=1 \
  --labels pointers,tma --out "$out/attention_ab.csv"
step fused 90 python bench_fused.py --out "$out/fused.csv"
step core 540 python bench_core.py --out "$out/core.csv"
delayed=(--strategy delayed_update=True --strategy delay_warmup=1 --strategy optimizer_state=bf16)  # issue 54's rows
step delayed 540 python bench_core.py --systems a,b --layers 8 --tokens 8192,32768 "${delayed[@]}" --out "$out/core.csv"
# what the recompute leaves out (the dead ends and the kept attention), both on and both off in turn (2.8 B, 32k
# tokens a step), at sequences of 4k and at one sequence of 32k
step recompute 590 bash -c 'for seq in 4096 32768; do for s in True False; do python bench_core.py --systems a \
  --layers 8 --tokens 32768 --seq $seq --schedules backward --engine skip_dead_ends=$s --engine keep_attention=$s \
  --out "$1/core.csv" || exit 1; done; done' _ "$out"
step delayed_8b 300 python bench_core.py --systems a --layers 32 --tokens 32768 --schedules forward "${delayed[@]}" \
  --out "$out/core.csv"
step memory_8b 300 python bench_memory.py --case 8b --out "$out/memory.csv"
step memory_8b_64k 330 python bench_memory.py --case 8b-64k --steps 1 --out "$out/memory.csv"  # ~200 s on the H200
step memory_3b_nvme 240 python bench_memory.py --case 3b-nvme --steps 2 --nvme-path "${SLIDE_NVME_PATH:-$HOME/slide-nvme}" \
  --out "$out/memory.csv"
step memory_3b_nvme_masters 240 python bench_memory.py --case 3b-nvme-masters --steps 2 \
  --nvme-path "${SLIDE_NVME_PATH:-$HOME/slide-nvme}" --out "$out/memory.csv"
step memory_32b_lora 400 python bench_memory.py --case 32b-lora --steps 2 --out "$out/memory.csv"
step nvme_io 200 python bench_nvme_io.py --dir "${SLIDE_NVME_PATH:-$HOME}" --out "$out/nvme_io.csv"
exit $status
