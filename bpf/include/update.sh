#!/usr/bin/env bash
# Copies libbpf's BPF-side headers from the installed libbpf-dev (Debian:
# apt-get install libbpf-dev) into this directory and records the version in
# README.md. Packages come from Debian here, not from GitHub tarballs.
set -euo pipefail
cd "$(dirname "$0")"
src=/usr/include/bpf
version=$(dpkg-query -W -f='${Version}' libbpf-dev 2>/dev/null) || { echo "libbpf-dev is not installed" >&2; exit 1; }
for h in bpf_helpers.h bpf_helper_defs.h bpf_endian.h; do
	install -m 0644 "$src/$h" "$h"
done
upstream=${version#*:}
upstream=${upstream%%-*}
sed -i -E "s/libbpf [0-9][^,]*, as Debian 12's \`libbpf-dev\` \([^)]*\)/libbpf ${upstream}, as Debian 12's \`libbpf-dev\` (${version})/" README.md
echo "libbpf headers from libbpf-dev ${version}; now run: make check-generate"
