#!/usr/bin/env bash
# h2spec.sh [OUTDIR]
# h2spec.sh --dir        print the default cache folder and exit, building nothing
#
# Builds h2spec (github.com/summerwind/h2spec, the HTTP/2 conformance suite) from the nested
# tools module test/h2spectool, for pkg/tunnel/hbone's TestH2Spec. The default OUTDIR is a
# cache folder keyed by a hash of test/h2spectool/go.mod and go.sum:
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/redirector/h2spec/<hash>/h2spec
#
# so a version bump builds into a new folder and an unchanged one is reused. The folder is
# printed on stdout at the end, so callers can do dir=$(hack/h2spec.sh). A cold build takes
# about 20 s.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools="$root/test/h2spectool"

# shellcheck source=hack/lib/cache.sh
source "$root/hack/lib/cache.sh"
log() { echo "h2spec: $*" >&2; }
have() { [[ -x "$out/h2spec" ]]; }

cache_out h2spec/ "${1:-}" "$tools/go.mod" "$tools/go.sum"
cache_build_lock

export CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly
cd "$tools"
log "building github.com/summerwind/h2spec into $out"
go build -trimpath -buildvcs=false -o "$tmp/h2spec" github.com/summerwind/h2spec/cmd/h2spec
mv "$tmp/h2spec" "$out/h2spec"
echo "$out"
