#!/usr/bin/env bash
# Unpack onnxruntime's C API headers (Debian's libonnxruntime-dev, from the trixie suite of the Debian mirror this
# machine's apt already uses) into DIR, without installing the package or changing the machine's apt sources;
# prints DIR/usr/include/onnxruntime. Needs a Debian machine (apt-get, dpkg-deb).
# `ctropt kernels build --include` takes the printed folder.
set -euo pipefail
dir=$(realpath -m "${1:?usage: fetch_ort_headers.sh DIR}")
inc="$dir/usr/include/onnxruntime"
if [ -f "$inc/onnxruntime_c_api.h" ]; then echo "$inc"; exit 0; fi
apt_dir="$dir/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -v '^\s*#' \
    | grep -oE '(https?|mirror)://[^ ]*/debian/?( |$)' | grep -v security | head -1 | tr -d ' ' || true)
[ -n "$mirror" ] || { echo "no Debian mirror in this machine's apt sources" >&2; exit 1; }
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" > "$apt_dir/sources.list"
opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o APT::Sandbox::User=root -q)
apt-get "${opts[@]}" update >/dev/null
(cd "$apt_dir" && apt-get "${opts[@]}" download libonnxruntime-dev >/dev/null)
dpkg-deb -x "$apt_dir"/libonnxruntime-dev_*.deb "$dir"
test -f "$inc/onnxruntime_c_api.h"
echo "$inc"
