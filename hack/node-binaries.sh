#!/usr/bin/env bash
# node-binaries.sh [OUTDIR]
# node-binaries.sh --dir        print the default cache folder and exit, building nothing
#
# Installs the Debian packages of the node (containerd, runc, containernetworking-plugins,
# buildah, busybox-static) if missing, and builds the node components of the real-node tests (test/e2enode): kubelet,
# kube-controller-manager, kube-scheduler and kubectl from the nested tools module
# test/nodetools, and helm from test/nodetools/helm. kube-apiserver and etcd come from
# hack/k8s-binaries.sh (its own cache) and are linked into the same folder, so a caller finds
# all seven in one place. The default OUTDIR is keyed by a hash of both tools modules:
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/redirector/node/<hash>/
#
# The build is skipped when every binary is already there. Progress goes to stderr; the folder
# is printed on stdout, so callers can do dir=$(hack/node-binaries.sh).
#
# A cold build of the four Kubernetes components and helm takes about 5-8 minutes on 2 cores
# (they share most packages with kube-apiserver, so a warm Go build cache helps); warm, seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools="$root/test/nodetools"
bins=(kubelet kube-controller-manager kube-scheduler kubectl helm)

# shellcheck source=hack/lib/cache.sh
source "$root/hack/lib/cache.sh"
log() { echo "node-binaries: $*" >&2; }

# The node's runtime side comes from Debian (idempotent, as `make deps`): containerd 1.6,
# runc, the CNI reference plugins, and what hack/build-image.sh needs.
debs=(containerd runc containernetworking-plugins buildah busybox-static iptables jq curl)
missing=$(for p in "${debs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [[ -n "$missing" && "${1:-}" != --dir ]]; then
	log "installing" $missing
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	# shellcheck disable=SC2086
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

have() {
	local b
	for b in "${bins[@]}" kube-apiserver etcd; do
		[[ -x "$out/$b" ]] || return 1
	done
}

cache_out node/ "${1:-}" "$tools/go.mod" "$tools/go.sum" "$tools/helm/go.mod" "$tools/helm/go.sum" \
	"$root/test/k8stools/go.mod" "$root/test/k8stools/go.sum"
cache_build_lock

k8s=$(bash "$root/hack/k8s-binaries.sh")

# The same fixed flags as hack/k8s-binaries.sh, so the packages Kubernetes components share
# come from the Go build cache. The -X version flags matter: without them kubectl and the
# kubelet report v0.0.0 and kubectl version fails to parse the server's answer.
export CGO_ENABLED=0 GOWORK=off GOFLAGS=-mod=readonly
version_pkg=k8s.io/component-base/version
flags=(
	-trimpath
	-buildvcs=false
	-ldflags "-s -w -X $version_pkg.gitVersion=v1.34.4 -X $version_pkg.gitMajor=1 -X $version_pkg.gitMinor=34"
)

start=$SECONDS
cd "$tools"
for b in kubelet kube-controller-manager kube-scheduler kubectl; do
	[[ -x "$out/$b" ]] && continue
	log "building $b into $out"
	go build "${flags[@]}" -o "$tmp/$b" "k8s.io/kubernetes/cmd/$b"
	mv "$tmp/$b" "$out/$b"
	log "$b done after $((SECONDS - start))s"
done
if [[ ! -x "$out/helm" ]]; then
	cd "$tools/helm"
	log "building helm into $out"
	go build -trimpath -buildvcs=false -ldflags "-s -w" -o "$tmp/helm" helm.sh/helm/v3/cmd/helm
	mv "$tmp/helm" "$out/helm"
	log "helm done after $((SECONDS - start))s"
fi
ln -sfn "$k8s/kube-apiserver" "$out/kube-apiserver"
ln -sfn "$k8s/etcd" "$out/etcd"
echo "$out"
