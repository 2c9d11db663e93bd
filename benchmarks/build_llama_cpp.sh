#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-batched-bench, llama-server, llama-quantize, llama-perplexity,
# llama-tokenize and the speculative decoding tools (llama-lookup: n-gram / prompt lookup;
# llama-speculative: draft model) from the sources vendored
# in the llama-cpp-python sdist (the package index is the only network here). The build is
# cached: ${TOKENMILL_HOME:-~/.cache/tokenmill}/llama.cpp/build/bin. Takes 10-20 min on 2 cores.
set -euo pipefail
home="${TOKENMILL_HOME:-$HOME/.cache/tokenmill}/llama.cpp"
bin="$home/build/bin"
# GGML_NATIVE builds for this CPU: a build made on another CPU (a copied cache) may die of an
# illegal instruction here, so the build records what -march=native meant and is redone on change
flags=$("${CC:-cc}" -march=native -E -v - < /dev/null 2>&1 || true)
native=$(printf '%s\n' "$flags" | grep cc1 | head -1 | sed 's/.* - //')
# ggml's AMX matmuls for quantized weights (its BF16 path has none) die of an illegal
# instruction in this vendored version (tilezero in tinygemm_kernel_amx, at any thread count,
# measured on an Emerald Rapids Xeon): build its AVX-512 VNNI paths instead where -march=native
# would enable AMX
cflags=""
case "$native" in *-mamx-tile*) cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;; esac
native=$(printf '%s %s\n' "$native" "$cflags" | md5sum | cut -c1-16)
if [ -d "$home/build" ] && [ "$(cat "$home/build/native.txt" 2>/dev/null)" != "$native" ]; then
  echo "llama.cpp was built for another CPU: rebuilding" >&2
  rm -rf "$home/build"
fi
if [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-server" ] && [ -x "$bin/llama-batched-bench" ] \
    && [ -x "$bin/llama-quantize" ] && [ -x "$bin/llama-lookup" ] && [ -x "$bin/llama-speculative" ] \
    && [ -x "$bin/llama-perplexity" ] && [ -x "$bin/llama-tokenize" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$home"
cd "$home"
if [ ! -d src ]; then
  python3 -m pip download --quiet --no-binary :all: --no-deps llama-cpp-python -d sdist >&2
  mkdir -p src
  tar -xzf sdist/llama_cpp_python-*.tar.gz -C src --strip-components=1
fi
cmake -S src/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" >&2
cmake --build build -j "$(nproc)" --target llama-bench llama-batched-bench llama-server llama-quantize \
  llama-lookup llama-speculative llama-perplexity llama-tokenize >&2
echo "$native" > "$home/build/native.txt"
echo "$bin"
