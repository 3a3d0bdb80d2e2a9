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

# shellcheck source=hack/lib/cache.sh
source "$root/hack/lib/cache.sh"
log() { echo "cni-plugins: $*" >&2; }
have() {
	local p
	for p in "${plugins[@]}"; do
		[[ -x "$out/$p" ]] || return 1
	done
}

cache_out cni-plugins/ "${1:-}" "$tools/go.mod" "$tools/go.sum" "$tools"/cnidriver/*.go
cache_build_lock

# The tools module is built on its own: no go.work, no GOFLAGS from the caller's environment.
export CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly

cd "$tools"
start=$SECONDS
log "building ${plugins[*]} into $out"
go build -trimpath -buildvcs=false -ldflags "-s -w" -o "$tmp/" "${pkgs[@]}"
for p in "${plugins[@]}"; do
	mv "$tmp/$p" "$out/$p"
done
log "done after $((SECONDS - start))s"
echo "$out"
