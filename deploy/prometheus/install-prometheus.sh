#!/bin/sh
# Makes Debian's prometheus and promtool available to the monitoring tests (`make test` runs
# this): the ones on PATH if there are any, otherwise the Debian package unpacked into
# .tools/prometheus/ (no root needed when apt's package lists exist, and unlike
# `apt-get install` no system service is enabled and started). Both are static Go binaries.
set -eu
cd "$(dirname "$0")/../.."
DEST=.tools/prometheus

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if [ -x "$DEST/usr/bin/prometheus" ] && [ -x "$DEST/usr/bin/promtool" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    echo "install-prometheus: the monitoring tests need prometheus and promtool on PATH;" \
         "install your system's prometheus package (macOS: brew install prometheus)" >&2
    exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# as root, apt would try (and warn about) handing the download to its _apt user
sandbox=""
if [ "$(id -u)" = 0 ]; then sandbox="-o APT::Sandbox::User=root"; fi
# shellcheck disable=SC2086
download() { (cd "$tmp" && apt-get download $sandbox prometheus); }

echo "install-prometheus: unpacking Debian's prometheus package into $DEST"
if ! download; then
    # a fresh machine has no package lists yet; refreshing them needs root
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
    elif command -v sudo >/dev/null 2>&1; then
        sudo apt-get update -qq
    else
        echo "install-prometheus: 'apt-get download prometheus' failed and refreshing apt's" \
             "lists needs root: run 'sudo apt-get update' (or install prometheus) and retry" >&2
        exit 1
    fi
    download
fi
rm -rf "$DEST"
mkdir -p "$DEST"
dpkg-deb -x "$tmp"/prometheus_*.deb "$DEST"
"$DEST/usr/bin/prometheus" --version 2>&1 | head -n 1
