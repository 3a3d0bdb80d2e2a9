#!/usr/bin/env bash
# istio-binaries.sh [OUTDIR]
# istio-binaries.sh --dir      print the default cache folder and exit, building nothing
#
# Builds istiod (pilot-discovery) from the nested tools module test/istiotools, for the istiod
# integration tests (test/istiotest, test/netns/istiod_*_test.go). The default OUTDIR is a
# cache folder keyed by a hash of test/istiotools/go.mod and go.sum:
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/redirector/istio/<hash>/pilot-discovery
#
# It also copies Istio's CRDs (manifests/charts/base/files/crd-all.gen.yaml of the same module
# version) there as crd-all.gen.yaml, since istiod's informers need them installed.
# The build is skipped when both files are already there. Progress goes to stderr; the folder
# is printed on stdout at the end, so callers can do dir=$(hack/istio-binaries.sh).
#
# Measured cold on 2 shared cores: see README.md ("Tests"); a warm one (Go build cache intact)
# takes seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools="$root/test/istiotools"

log() { echo "istio-binaries: $*" >&2; }

hash=$(cat "$tools/go.mod" "$tools/go.sum" | sha256sum | cut -c1-16)
out="${XDG_CACHE_HOME:-$HOME/.cache}/redirector/istio/$hash"
if [[ "${1:-}" == --dir ]]; then
	echo "$out"
	exit 0
fi
out=${1:-$out}

have() { [[ -x "$out/pilot-discovery" && -s "$out/crd-all.gen.yaml" ]]; }

if have; then
	log "up to date in $out"
	echo "$out"
	exit 0
fi

mkdir -p "$out"
# Concurrent test binaries may all ask at once: one builds, the others wait and then find it.
exec 9>"$out/.lock"
flock 9
if have; then
	log "built by another process in $out"
	echo "$out"
	exit 0
fi

# One fixed set of flags, so a rebuild hits the Go build cache. The tools module is built on
# its own: no go.work, no GOFLAGS from the caller's environment.
export CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly
flags=(-trimpath -buildvcs=false -ldflags "-s -w")

tmp=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

cd "$tools"
start=$SECONDS
log "building pilot-discovery (istio.io/istio) into $out (several minutes when cold)"
go build "${flags[@]}" -o "$tmp/pilot-discovery" istio.io/istio/pilot/cmd/pilot-discovery
log "pilot-discovery done after $((SECONDS - start))s"

moddir=$(go list -m -f '{{.Dir}}' istio.io/istio)
cp "$moddir/manifests/charts/base/files/crd-all.gen.yaml" "$tmp/crd-all.gen.yaml"
chmod u+w "$tmp/crd-all.gen.yaml"

mv "$tmp/crd-all.gen.yaml" "$out/crd-all.gen.yaml"
mv "$tmp/pilot-discovery" "$out/pilot-discovery"
echo "$out"
