#!/usr/bin/env bash
# k8s-binaries.sh [OUTDIR]
# k8s-binaries.sh --dir        print the default cache folder and exit, building nothing
#
# Builds kube-apiserver and etcd from the nested tools module test/k8stools, for the
# Kubernetes integration tests (test/kubetest). The default OUTDIR is a cache folder keyed by a
# hash of test/k8stools/go.mod and go.sum:
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/redirector/k8s/<hash>/{kube-apiserver,etcd}
#
# so a version bump in the tools module builds into a new folder and an unchanged one is reused.
# The build is skipped when both binaries are already there. Progress goes to stderr; the
# folder is printed on stdout at the end, so callers can do dir=$(hack/k8s-binaries.sh).
#
# A cold build takes 5-7 minutes on 2 cores (about 2 GB RSS, 3 GB of Go caches); a warm one
# (same flags, Go build cache intact, new hash) about 10 s.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools="$root/test/k8stools"

# shellcheck source=hack/lib/cache.sh
source "$root/hack/lib/cache.sh"
log() { echo "k8s-binaries: $*" >&2; }
have() { [[ -x "$out/kube-apiserver" && -x "$out/etcd" ]]; }

cache_out k8s/ "${1:-}" "$tools/go.mod" "$tools/go.sum"
cache_build_lock

# One fixed set of flags: any change (-trimpath, CGO_ENABLED, tags) forces a full recompile
# of Kubernetes instead of a warm build-cache hit.
# The tools module is built on its own: no go.work, no GOFLAGS from the caller's environment.
export CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly
version_pkg=k8s.io/component-base/version
flags=(
	-trimpath
	-buildvcs=false
	-ldflags "-s -w -X $version_pkg.gitVersion=v1.34.4 -X $version_pkg.gitMajor=1 -X $version_pkg.gitMinor=34"
)

cd "$tools"
start=$SECONDS
log "building etcd (go.etcd.io/etcd/server/v3) into $out"
go build "${flags[@]}" -o "$tmp/etcd" go.etcd.io/etcd/server/v3
log "etcd done after $((SECONDS - start))s; building kube-apiserver (several minutes when cold)"
go build "${flags[@]}" -o "$tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
log "kube-apiserver done after $((SECONDS - start))s"

mv "$tmp/etcd" "$out/etcd"
mv "$tmp/kube-apiserver" "$out/kube-apiserver"
echo "$out"
