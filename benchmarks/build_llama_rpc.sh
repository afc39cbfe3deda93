#!/usr/bin/env bash
# Dev-only: build llama.cpp's RPC peer (the binaries ggml_dist/testbed/llamacpp_rpc.py drives) from the llama.cpp
# vendored in the llama-cpp-python sdist, into a cache dir outside the git tree. Nothing in the package needs it.
#
#     benchmarks/build_llama_rpc.sh            # ~10 min on 2 cores; prints the bin dir as its last stdout line
#
# Builds only what the comparison runs: ggml-rpc-server (this llama.cpp's name for `rpc-server`), llama-batched-bench,
# and llama-completion, one more file to compile, whose startup `system_info` line lists the CPU features the build
# uses. llama-cli is left out: in this version it is the server's client and drags in the server and its web UI.
# Static binaries (-DBUILD_SHARED_LIBS=OFF), so the bin dir is self-contained. Release, -DGGML_RPC=ON, no network
# libraries (LLAMA_CURL, which this version no longer has, and LLAMA_OPENSSL, which replaced it).
#
# CPU flags: native, minus AMX. These VMs list amx_tile/amx_int8/amx_bf16 in /proc/cpuinfo but do not grant the
# AMX tile state, so a -march=native build's AMX path (ggml-cpu/amx, taken when __AMX_INT8__ is defined) segfaults.
# With GGML_NATIVE ggml only adds -march=native and ignores its GGML_AMX_* options, so AMX is switched off with
# -mno-amx-* in CMAKE_{C,CXX}_FLAGS (GCC keeps an explicit -mno-* over what -march=native implies, in either order).
# The script checks the result: system_info must not list AMX_INT8.
#
# Environment: GGML_DIST_CACHE (default ~/.cache/ggml_dist), LLAMA_CPP_PYTHON_VERSION (default 0.3.36),
# LLAMA_RPC_CHECK_MODEL (a GGUF for the system_info check; default: `ggml-dist pull smollm2-135m`).
# Layout under $GGML_DIST_CACHE/llama-rpc: src/ (the sdist), build/<key>/ (cmake's tree; delete at will),
# <key>/bin/ (the binaries and system_info.txt), with key = <version>-native[-noamx].
set -euo pipefail

version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
root=${GGML_DIST_CACHE:-$HOME/.cache/ggml_dist}/llama-rpc
binaries=(ggml-rpc-server llama-batched-bench llama-completion)
say() { echo "build_llama_rpc: $*" >&2; }

# what -march=native turns on here decides the flavour; /proc/cpuinfo is what the VM advertises
native_amx=$(gcc -march=native -dM -E - </dev/null | grep -o '__AMX_[A-Z0-9]*__' | sort -u | xargs || true)
cpuinfo_amx=$(grep -o -w 'amx_[a-z0-9]*' /proc/cpuinfo | sort -u | xargs || true)
cflags=""
key="$version-native"
if [[ -n "$native_amx$cpuinfo_amx" ]]; then
    cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    key="$key-noamx"
    say "AMX detected (/proc/cpuinfo: ${cpuinfo_amx:-none}; -march=native defines: ${native_amx:-none});" \
        "building native with '$cflags' so ggml compiles no AMX path"
else
    say "no AMX in /proc/cpuinfo or -march=native: plain native build"
fi
bin="$root/$key/bin"

have_all() { for b in "${binaries[@]}"; do [[ -x "$bin/$b" ]] || return 1; done; }
if have_all && [[ -s "$bin/system_info.txt" ]]; then
    say "already built: $(cat "$bin/system_info.txt")"
    echo "$bin"
    exit 0
fi

# 1. the sdist, from PyPI, unpacked once
src="$root/src/llama_cpp_python-$version"
if [[ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]]; then
    mkdir -p "$root/src"
    tarball="$root/src/llama_cpp_python-$version.tar.gz"
    [[ -f "$tarball" ]] || pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root/src" >&2
    tar -xzf "$tarball" -C "$root/src"
fi
llama="$src/vendor/llama.cpp"

# 2. configure and build the three targets, -j2 once (the machine's 2 cores are shared)
build="$root/build/$key"
say "configuring $llama in $build"
cmake -S "$llama" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_RPC=ON -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF >&2
start=$(date +%s)
cmake --build "$build" --target "${binaries[@]}" -j2 >&2
say "built in $(( $(date +%s) - start )) s"

# 3. check there is no AMX in what was compiled, then install
model=${LLAMA_RPC_CHECK_MODEL:-$(ggml-dist pull smollm2-135m | tail -n 1)}
info=$("$build/bin/llama-completion" -m "$model" -p hi -n 1 -t 1 -no-cnv --no-warmup 2>&1 </dev/null \
       | grep -m 1 -o 'system_info:.*' || true)
if [[ -z "$info" ]]; then
    say "llama-completion printed no system_info line on $model; run it by hand to see why"
    exit 1
fi
if [[ -n "$cflags" && "$info" == *AMX* ]]; then
    say "AMX is still compiled in, the binaries would segfault here: $info"
    exit 1
fi
mkdir -p "$bin"
for b in "${binaries[@]}"; do install -m 755 "$build/bin/$b" "$bin/$b"; done
echo "$info" > "$bin/system_info.txt"
say "$info"
echo "$bin"
