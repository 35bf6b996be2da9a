#!/bin/bash
# Builds STUNner's turncat and stunnerd, at the version pinned in this module's go.mod, into BIN_DIR,
# and the current release's stunnerd (stunner121/go.mod) as BIN_DIR/stunnerd-v1.2.1.
#
# `go install github.com/l7mp/stunner/cmd/turncat@v1.1.0` does not work: the proxy refuses stunner's
# version list and `go install mod@version` ignores the replace directive that points pion/turn at
# STUNner's fork. This separate module carries that replace and a committed go.sum instead.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 BIN_DIR" >&2; exit 2; }
mkdir -p "$1"
BIN_DIR=$(cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")"

# The fork is not in the checksum database; go.sum pins it, this only matters if go.sum is regenerated.
export GONOSUMDB=github.com/l7mp/turn${GONOSUMDB:+,$GONOSUMDB}
# -mod=readonly: a build never rewrites the committed go.mod/go.sum (run `go mod tidy` to change pins).
# -buildvcs=false: the enclosing repository's VCS state says nothing about these binaries.
export GOFLAGS="-mod=readonly -buildvcs=false"

version=$(go list -m -f '{{.Version}}' github.com/l7mp/stunner)
ldflags="-X main.version=$version -X main.commitHash=n/a -X main.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
for cmd in turncat stunnerd; do
	go build -trimpath -ldflags "$ldflags" -o "$BIN_DIR/$cmd" "github.com/l7mp/stunner/cmd/$cmd"
done
echo "built $BIN_DIR/turncat and $BIN_DIR/stunnerd (STUNner $version)"

# v1.2 builds against upstream pion/turn v5: no replace, its own module.
cd stunner121
version=$(go list -m -f '{{.Version}}' github.com/l7mp/stunner)
ldflags="-X main.version=$version -X main.commitHash=n/a -X main.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
go build -trimpath -ldflags "$ldflags" -o "$BIN_DIR/stunnerd-$version" github.com/l7mp/stunner/cmd/stunnerd
echo "built $BIN_DIR/stunnerd-$version"
