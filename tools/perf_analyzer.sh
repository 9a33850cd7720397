#!/usr/bin/env bash
# Installs Triton's perf_analyzer into DIR (default .cache/perf-analyzer) and writes DIR/perf_analyzer,
# a wrapper that runs it; prints the wrapper's path. Idempotent.
#
# PyPI's perf-analyzer wheels (2.58+) are built for glibc 2.38 (manylinux_2_38). Where the host's
# glibc is that new, pip installs the wheel and the wrapper runs it. On an older host (Debian 12 has
# glibc 2.36; pip then quietly picks a placeholder without the binary) the wheel is unpacked as it
# is, and the wrapper runs its binary through the dynamic loader and C/C++ libraries of Debian 13,
# fetched from the host's own Debian mirror with a private apt configuration (nothing is installed
# system-wide). Needs python3 with pip, and apt-get + dpkg-deb on the older hosts.
#   bash tools/perf_analyzer.sh [DIR]
set -euo pipefail
dir=$(realpath -m "${1:-.cache/perf-analyzer}")
version=2.60.0
wrapper=$dir/perf_analyzer
if [ -x "$wrapper" ] && "$wrapper" --version >/dev/null 2>&1; then echo "$wrapper"; exit 0; fi
mkdir -p "$dir"
glibc=$(getconf GNU_LIBC_VERSION | awk '{print $2}')  # no early-closing pipe: pipefail would see SIGPIPE
python3 -m pip download -q --no-deps "perf-analyzer==$version" --only-binary=:all: \
  --platform manylinux_2_38_x86_64 -d "$dir/wheel-dl" >&2
rm -rf "$dir/wheel" && python3 -m zipfile -e "$dir"/wheel-dl/perf_analyzer-*.whl "$dir/wheel"
binary=$dir/wheel/perf_analyzer/bin/perf_analyzer
chmod +x "$binary"
if printf '%s\n2.38\n' "$glibc" | sort -V -C -r; then  # the host's glibc is 2.38 or newer
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$binary" > "$wrapper"
else
  apt=$dir/apt && mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/parts"
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null ||
           awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
  printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: %s\n' "$mirror" \
    /usr/share/keyrings/debian-archive-keyring.gpg > "$apt/parts/trixie.sources"
  options=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$apt/parts"
           -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o Debug::NoLocking=1
           -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o APT::Sandbox::User=root)
  apt-get -qq "${options[@]}" update >&2
  (cd "$apt" && apt-get -qq "${options[@]}" download libc6 libstdc++6 libgcc-s1 libssl3t64 \
    zlib1g >&2)
  rm -rf "$dir/root" && for deb in "$apt"/*.deb; do dpkg-deb -x "$deb" "$dir/root"; done
  libs=$dir/root/usr/lib/x86_64-linux-gnu
  printf '#!/bin/sh\nexec "%s/ld-linux-x86-64.so.2" --library-path "%s" "%s" "$@"\n' \
    "$libs" "$libs" "$binary" > "$wrapper"
fi
chmod +x "$wrapper"
"$wrapper" --version >/dev/null 2>&1 || { echo "perf_analyzer does not run: $wrapper" >&2; exit 1; }
echo "$wrapper"
