#!/usr/bin/env bash
# llama.cpp's llama-server, built from the llama.cpp that llama-cpp-python 0.3.36 vendors (the release
# kvviz's llama.cpp backend pins), into the kvviz cache, once: a later run that finds it there prints
# its path and builds nothing. CPU only, Release, the llama-server target alone, llama.cpp's libraries linked in;
# no web UI (neither npm nor a download: the server answers its API without one) and no HTTPS, so it
# builds offline once the source is here. 10 minutes on 2 busy shared cores, 7 minutes of CPU
# (docs/engines.md); .ci/run runs it before the tests, and tests/test_audit_servers.py skips llama-server
# where it is not built.
#
#   scripts/build_llama_server.sh            build if needed; print the binary's path last
#   LLAMA_SERVER_SRC=DIR scripts/...         build from an unpacked sdist already here (no pip download)
#   JOBS=N scripts/...                       compile with N jobs (default: every core)
#
# The binary: ${KVVIZ_CACHE:-${XDG_CACHE_HOME:-~/.cache}/kvviz}/llama-server-0.3.36/llama-server
# (tests/test_audit_servers.py looks there, or at $KVVIZ_LLAMA_SERVER).
set -euo pipefail

VERSION=0.3.36
CACHE="${KVVIZ_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvviz}"
DEST="$CACHE/llama-server-$VERSION"
BIN="$DEST/llama-server"

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi
for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "build_llama_server: $tool is needed and not found" >&2; exit 1; }
done

mkdir -p "$CACHE"
WORK="$(mktemp -d "$CACHE/.llama-server-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

if [ -n "${LLAMA_SERVER_SRC:-}" ]; then
    SRC="$LLAMA_SERVER_SRC"
else
    echo "build_llama_server: fetching the llama-cpp-python $VERSION source distribution from PyPI" >&2
    python -m pip download --disable-pip-version-check --no-input -q --no-deps --no-binary :all: \
        -d "$WORK" "llama-cpp-python==$VERSION"
    tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
    SRC="$WORK/llama_cpp_python-$VERSION"
fi
LLAMA="$SRC/vendor/llama.cpp"
[ -f "$LLAMA/tools/server/CMakeLists.txt" ] || { echo "build_llama_server: no llama-server source in $LLAMA" >&2; exit 1; }

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
start=$(date +%s)
cmake -S "$LLAMA" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$WORK/configure.log" 2>&1 ||
    { tail -30 "$WORK/configure.log" >&2; echo "build_llama_server: cmake could not configure llama.cpp" >&2; exit 1; }
cmake --build "$WORK/build" --target llama-server -j "${JOBS:-$(nproc)}" >"$WORK/build.log" 2>&1 ||
    { tail -30 "$WORK/build.log" >&2; echo "build_llama_server: the llama-server build failed" >&2; exit 1; }
echo "build_llama_server: built in $(( $(date +%s) - start )) s" >&2

mkdir -p "$DEST"
cp "$WORK/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"  # in place only once whole
"$BIN" --version >&2
echo "$BIN"
