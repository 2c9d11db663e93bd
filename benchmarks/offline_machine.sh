#!/usr/bin/env bash
# Issue 17's measurements on a machine with no package index (a lent machine): prepare a small
# bundle here, carry it there with the working tree, run there.
#
#   bash benchmarks/offline_machine.sh prepare [DIR] [PYTHON_VERSION]   # here (default .offline, 3.12)
#   bash benchmarks/offline_machine.sh run [DIR]                        # there, in the repo root
#
# The bundle (~25 MB): llama.cpp's sources trimmed to the CPU build, wheels of tokenmill's
# dependencies that such a machine lacks (installed with pip --no-index into its Python), the
# benchmark model's skeleton (shape_model.py: same shapes, random weights; speed only) and the
# test fixtures. `run` prints the CPU, runs the kernel and model tests on every kernel build the
# CPU runs, then compare_llamacpp, serve_compare (tokenmill and llama-server), throughput,
# startup and thread_scaling (also with the OpenMP pool bound to cores, and passive), eight
# logs under $OUT (default /tmp/offline-out). The GPU, if any,
# is hidden: these are CPU numbers. vLLM CPU is not in the bundle (it and its torch are ~1 GB).
set -u
cmd=${1:?prepare or run}; dir=${2:-.offline}
if [ "$cmd" = prepare ]; then
  set -e
  pyver=${3:-3.12}
  mkdir -p "$dir/wheels"
  src="$(dirname "$(bash benchmarks/build_llama_cpp.sh)")/../src/vendor/llama.cpp"
  drop=(models docs media benches tests gguf-py conversion skills)
  for b in cuda sycl vulkan metal opencl hexagon et cann musa hip webgpu openvino zdnn virtgpu; do
    drop+=("ggml/src/ggml-$b")
  done
  tar -czf "$dir/llama-src.tar.gz" -C "$src" "${drop[@]/#/--exclude=./}" .
  python3 benchmarks/shape_model.py skeleton "$dir/skel.gguf"
  fixtures=${TOKENMILL_FIXTURES:-../shared/fixtures}
  [ -d "$fixtures" ] && rm -rf "$dir/fixtures" && cp -r "$fixtures" "$dir/fixtures" \
    && chmod -R u+w "$dir/fixtures"
  plat=(); for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 \
    manylinux_2_31_x86_64 manylinux_2_34_x86_64; do plat+=(--platform "$p"); done
  for req in gguf fastapi starlette pydantic pydantic_core annotated-types typing-inspection \
      uvicorn llguidance opentelemetry-api typing_extensions annotated-doc; do
    v=$(python3 -m pip show "$req" 2>/dev/null | sed -n 's/^Version: //p')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
      --implementation cp "${plat[@]}" -d "$dir/wheels" "$req${v:+==$v}"
  done
  du -sh "$dir"
  exit 0
fi

OUT=${OUT:-/tmp/offline-out}; mkdir -p "$OUT"
T0=$(date +%s); t() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
export CUDA_VISIBLE_DEVICES="" TOKENMILL_HOME=${TOKENMILL_HOME:-/tmp/tmhome} PYTHONUNBUFFERED=1
export TOKENMILL_FIXTURES=$PWD/$dir/fixtures
PY=${PY:-python3}
{
  lscpu; ${CXX:-c++} --version | head -1
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    "$dir"/wheels/*.whl 2>&1 | tail -2
  $PY -c "import torch, tokenmill.kernels.isa as i; print('torch', torch.__version__, \
torch.get_num_threads(), 'threads'); print(i.describe_cpu(), i.supported_isas())"
} > "$OUT/info.txt" 2>&1
tail -2 "$OUT/info.txt"
home=$TOKENMILL_HOME/llama.cpp
if [ ! -x "$home/build/bin/llama-server" ]; then
  mkdir -p "$home/src/vendor/llama.cpp"
  tar -xzf "$dir/llama-src.tar.gz" -C "$home/src/vendor/llama.cpp"
  (nice -n 19 bash benchmarks/build_llama_cpp.sh > "$OUT/llama_build.log" 2>&1) &
fi
M=$($PY benchmarks/shape_model.py fill "$dir/skel.gguf")
t "tests: kernels and models on each instruction set"
tests=$(echo tests/test_{kernels,quant_kernels,kv_kernels,attention_lanes,kernel_dispatch,models,\
engine,quantized_models,llama2c,spec_decode,gemma3,deepseek,deepseek_v4,phi3,gpt2,kv_int4,kv_cache,\
hf_quant_formats,gguf_blocks}.py)
xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n $(( $(nproc) > 12 ? 12 : $(nproc) ))")
timeout "${TEST_BUDGET:-300}" $PY -m pytest -q $xdist -p no:cacheprovider -rfE \
  -m "not smollm2 and not gemma3 and not slow" $tests > "$OUT/tests.log" 2>&1
echo "pytest rc $?" >> "$OUT/tests.log"; tail -4 "$OUT/tests.log"
t "waiting for the llama.cpp build"; wait; tail -1 "$OUT/llama_build.log" 2>/dev/null
run() { local name=$1 limit=$2; shift 2; t "$name" | tee -a "$OUT/$name.log"
  timeout "$limit" "$@" >> "$OUT/$name.log" 2>&1; tail -"${TAIL:-8}" "$OUT/$name.log"; }
run compare 200 $PY benchmarks/compare_llamacpp.py --model "$M" --rounds 2
run serve 240 $PY benchmarks/serve_compare.py --model "$M" --engines tokenmill,llama.cpp \
  --num-prompts 32
OMP_NUM_THREADS=2 run throughput 240 $PY benchmarks/throughput.py --model "$M" --num-prompts 24
run startup 120 $PY benchmarks/startup.py --model "$M" --runs 2
run thread_scaling 300 $PY benchmarks/thread_scaling.py --model "$M" --gen 64
# the OpenMP pool pinned (a spinning worker can no longer share the Python thread's core) and
# sleeping at once: tokenmill only, llama.cpp runs its own threads
OMP_PROC_BIND=close OMP_PLACES=cores run thread_scaling 200 $PY benchmarks/thread_scaling.py \
  --model "$M" --gen 64 --skip-llama
OMP_WAIT_POLICY=PASSIVE run thread_scaling 200 $PY benchmarks/thread_scaling.py \
  --model "$M" --gen 64 --skip-llama
t done
