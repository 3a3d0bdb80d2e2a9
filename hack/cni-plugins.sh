#!/usr/bin/env bash
# cni-plugins.sh [OUTDIR]
# cni-plugins.sh --dir        print the default cache folder and exit, building nothing
#
# Builds the reference CNI plugins bridge, ptp, loopback and host-local, and cnidriver (a libcni
# caller playing the container runtime), from the nested tools module test/cniplugins, for the
# redirector-cni chain tests (cmd/redirector-cni). The default OUTDIR is a cache folder keyed by
# a hash of test/cniplugins/go.mod, go.sum and the driver's source:
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/redirector/cni-plugins/<hash>/{bridge,ptp,loopback,host-local,cnidriver}
#
# so a version bump or a driver change builds into a new folder and an unchanged one is reused.
# The build is skipped when all five are already there. Progress goes to stderr; the folder is
# printed on stdout at the end, so callers can do dir=$(hack/cni-plugins.sh).
#
# A fully cold build (empty module and build caches) compiles about 90 packages: about 25 s on
# 2 cores, with 70 MB of module downloads.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools="$root/test/cniplugins"
plugins=(bridge ptp loopback host-local cnidriver)
pkgs=(
	github.com/containernetworking/plugins/plugins/main/bridge
	github.com/containernetworking/plugins/plugins/main/ptp
	github.com/containernetworking/plugins/plugins/main/loopback
	github.com/containernetworking/plugins/plugins/ipam/host-local
	./cnidriver
)

log() { echo "cni-plugins: $*" >&2; }

hash=$(cat "$tools/go.mod" "$tools/go.sum" "$tools"/cnidriver/*.go | sha256sum | cut -c1-16)
out="${XDG_CACHE_HOME:-$HOME/.cache}/redirector/cni-plugins/$hash"
if [[ "${1:-}" == --dir ]]; then
	echo "$out"
	exit 0
fi
out=${1:-$out}

have() {
	local p
	for p in "${plugins[@]}"; do
		[[ -x "$out/$p" ]] || return 1
	done
}

if have; then
	log "up to date in $out"
	echo "$out"
	exit 0
fi

mkdir -p "$out"
# Concurrent test binaries may all ask at once: one builds, the others wait and then find
# the binaries present.
exec 9>"$out/.lock"
flock 9
if have; then
	log "built by another process in $out"
	echo "$out"
	exit 0
fi

# The tools module is built on its own: no go.work, no GOFLAGS from the caller's environment.
export CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly

# Build into a temporary folder and move into place, so an interrupted build never leaves a
# half-written binary that "have" would accept.
tmp=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

cd "$tools"
start=$SECONDS
log "building ${plugins[*]} into $out"
go build -trimpath -buildvcs=false -ldflags "-s -w" -o "$tmp/" "${pkgs[@]}"
for p in "${plugins[@]}"; do
	mv "$tmp/$p" "$out/$p"
done
log "done after $((SECONDS - start))s"
echo "$out"
