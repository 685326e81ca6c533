#!/bin/sh
# Build llama.cpp's native `llama-server` once, from the llama.cpp tree vendored in the
# llama-cpp-python sdist (PyPI is reachable here, GitHub is not), and cache it:
#   .tools/llama.cpp/bin/llama-server   a static binary (no shared ggml/llama libraries)
#   .tools/llama.cpp/VERSION            "llama-cpp-python==<v> llama.cpp@<commit>"
# Idempotent: exits at once when the binary exists and VERSION matches the pin below.
# CPU build for this machine (GGML_NATIVE: -march=native, so AVX2/AVX-512/AMX as the CPU has
# them), Release, no libcurl/OpenSSL, no web UI download. ~13 min on 2 cores.
#   sh bench/peers/build_llamacpp.sh            (what `make peers` runs)
#   PIP=".venv/bin/python -m pip" JOBS=4 sh bench/peers/build_llamacpp.sh
set -eu

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # vendors llama.cpp@0c1e57098
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="${LLAMA_CPP_DIR:-$ROOT/.tools/llama.cpp}"
PIP="${PIP:-$ROOT/.venv/bin/python -m pip}"
JOBS="${JOBS:-2}"
BIN="$DEST/bin/llama-server"
STAMP="$DEST/VERSION"

if [ -x "$BIN" ] && [ -f "$STAMP" ] && \
        grep -q "^llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION " "$STAMP"; then
    echo "llama-server is built: $BIN ($(cat "$STAMP"))"
    exit 0
fi
command -v cmake >/dev/null || { echo "cmake is needed to build llama-server" >&2; exit 1; }

mkdir -p "$DEST"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/llamacpp-build.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT INT TERM
start=$(date +%s)

echo "downloading the llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist"
$PIP download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
    -d "$TMP/dl"
SDIST="$(ls "$TMP"/dl/llama_cpp_python-*.tar.gz)"
tar -xzf "$SDIST" -C "$TMP"
PKG="$TMP/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
SRC="$PKG/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in $SDIST" >&2; exit 1; }
# the sdist has no .git: take the llama.cpp commit from its changelog's newest "update llama.cpp"
COMMIT="$(grep -o 'ggml-org/llama.cpp@[0-9a-f]*' "$PKG/CHANGELOG.md" 2>/dev/null | head -n1 \
    | cut -d@ -f2)"
COMMIT="${COMMIT:-unknown}"

echo "configuring llama.cpp@$COMMIT"
# LLAMA_BUILD_COMMIT/NUMBER given explicitly: the tree has no .git, and git must not pick up an
# enclosing repository's commit; LLAMA_CURL is gone in recent trees (a deprecation warning)
cmake -S "$SRC" -B "$TMP/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_COMMIT="$COMMIT" -DLLAMA_BUILD_NUMBER=0 >"$TMP/configure.log" 2>&1 || {
        tail -n 40 "$TMP/configure.log" >&2; exit 1; }
echo "building llama-server (-j$JOBS)"
cmake --build "$TMP/build" --config Release --target llama-server -j "$JOBS" \
    >"$TMP/build.log" 2>&1 || { tail -n 60 "$TMP/build.log" >&2; exit 1; }

mkdir -p "$DEST/bin"
cp "$TMP/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
echo "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION llama.cpp@$COMMIT" > "$STAMP"
echo "built $BIN ($(cat "$STAMP")) in $(( $(date +%s) - start )) s"
