#!/usr/bin/env bash
# istio-binaries.sh [OUTDIR]
# istio-binaries.sh --dir      print the default cache folder and exit, building nothing
# istio-binaries.sh istioctl [OUTDIR | --dir]
#                              the same for istioctl (see below)
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
# istioctl, for the check that Istio's tools read the agent's config dump
# (test/netns/istioctl_test.go), is built from test/istiotools/istioctl: a module of its own, so
# that its extra dependencies do not change the pilot-discovery cache key, pinned to the same
# istio.io/istio version and the same versions of every shared module (the script refuses a
# mismatch). It goes to ${XDG_CACHE_HOME:-$HOME/.cache}/redirector/istio/istioctl-<hash>/istioctl.
#
# Measured cold on 2 shared cores: see README.md ("Tests"); a warm one (Go build cache intact)
# takes seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools="$root/test/istiotools"

# shellcheck source=hack/lib/cache.sh
source "$root/hack/lib/cache.sh"
log() { echo "istio-binaries: $*" >&2; }

# One fixed set of flags, so a rebuild hits the Go build cache. The tools modules are built on
# their own: no go.work, no GOFLAGS from the caller's environment.
export CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly
flags=(-trimpath -buildvcs=false -ldflags "-s -w")

if [[ "${1:-}" == istioctl ]]; then
	shift
	mod="$tools/istioctl"
	have() { [[ -x "$out/istioctl" ]]; }
	cache_out istio/istioctl- "${1:-}" "$mod/go.mod" "$mod/go.sum"
	cache_build_lock
	want=$(cd "$tools" && go list -m -f '{{.Version}}' istio.io/istio)
	got=$(cd "$mod" && go list -m -f '{{.Version}}' istio.io/istio)
	if [[ "$want" != "$got" ]]; then
		log "test/istiotools/istioctl pins istio.io/istio $got, test/istiotools $want: make them equal"
		exit 1
	fi
	start=$SECONDS
	log "building istioctl (istio.io/istio $got) into $out (minutes when cold)"
	(cd "$mod" && go build "${flags[@]}" -o "$tmp/istioctl" istio.io/istio/istioctl/cmd/istioctl)
	log "istioctl done after $((SECONDS - start))s"
	mv "$tmp/istioctl" "$out/istioctl"
	echo "$out"
	exit 0
fi

have() { [[ -x "$out/pilot-discovery" && -s "$out/crd-all.gen.yaml" ]]; }
cache_out istio/ "${1:-}" "$tools/go.mod" "$tools/go.sum"
cache_build_lock

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
