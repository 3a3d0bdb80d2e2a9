#!/usr/bin/env bash
# build-image.sh OUTDIR [TAG]
#
# Builds, without Docker, the images of the real-node tests (test/e2enode) as docker-archive
# tarballs in OUTDIR, for `ctr -n k8s.io images import` (or `docker load`):
#
#   OUTDIR/redirector-TAG.tar  localhost/redirector:TAG, the product image: the same binaries
#                              (redirector, redirector-cni: CGO_ENABLED=0, -trimpath,
#                              -ldflags "-s -w -X main.version=TAG -X main.commit=...
#                              -X main.buildDate=..."), the same node script
#                              (manifests/image/redirector-node, 0755), the same entrypoint,
#                              command and user as the Dockerfile. Its base differs: instead
#                              of debian-slim + jq + curl (no registry is reachable), the small
#                              tools come from busybox-static, and sh (dash), jq, curl, stat,
#                              cmp and mount are the host's Debian ones, with their shared
#                              libraries.
#   OUTDIR/app.tar             localhost/e2enode/app:1, busybox-static: httpd with a CGI that
#                              echoes the client's address, wget, nc.
#   OUTDIR/pause.tar           localhost/e2enode/pause:1, test/e2enode/pause.
#
# The rootfs is assembled on the host and committed with buildah (vfs storage, a private
# store in OUTDIR, removed at the end); `buildah run` is never used (it would bring up
# podman's bridge and turn on forwarding). Installs buildah and busybox-static if missing.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: build-image.sh OUTDIR [TAG]}
tag=${2:-$(git -C "$root" describe --always --dirty 2>/dev/null || echo dev)}
export PATH=$PATH:/usr/local/go/bin

log() { echo "build-image: $*" >&2; }

missing=$(for p in buildah busybox-static jq curl; do dpkg -s $p >/dev/null 2>&1 || echo $p; done)
if [[ -n "$missing" ]]; then
	log "installing" $missing
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	# shellcheck disable=SC2086
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "$out/.work.XXXXXX")
store=(--storage-driver vfs --root "$work/storage" --runroot "$work/run")
# buildah initialises its network backend even without `run`, and that writes
# /etc/cni/net.d/cni.lock: point it at the work folder instead.
mkdir -p "$work/cni"
printf '[network]\nnetwork_config_dir = "%s"\n' "$work/cni" >"$work/containers.conf"
export CONTAINERS_CONF="$work/containers.conf"
cleanup() {
	buildah "${store[@]}" rm --all >/dev/null 2>&1 || true
	rm -rf "$work"
}
trap cleanup EXIT

# busybox_root DIR: busybox-static with its applets as symlinks in DIR/bin.
busybox_root() {
	mkdir -p "$1/bin" "$1/tmp" "$1/etc"
	chmod 1777 "$1/tmp"
	cp /bin/busybox "$1/bin/busybox"
	local a
	for a in $(/bin/busybox --list); do
		[[ -e "$1/bin/$a" ]] || ln -s busybox "$1/bin/$a"
	done
	echo 'root:x:0:0:root:/:/bin/sh' >"$1/etc/passwd"
	echo 'root:x:0:' >"$1/etc/group"
}

# with_libs DIR BIN...: copies each host binary and the shared libraries it loads into DIR,
# at the same paths.
with_libs() {
	local dir=$1 f
	shift
	for f in "$@" $(ldd "$@" | awk '/=>/ {print $3} /^[ \t]*\/lib/ {print $1}' | sort -u); do
		mkdir -p "$dir$(dirname "$f")"
		cp -L "$f" "$dir$f"
	done
}

# commit DIR NAME TARBALL [buildah config args...]
commit() {
	local dir=$1 name=$2 tarball=$3 c
	shift 3
	c=$(buildah "${store[@]}" from scratch)
	buildah "${store[@]}" copy --quiet "$c" "$dir" / >/dev/null
	buildah "${store[@]}" config "$@" "$c"
	buildah "${store[@]}" commit --quiet --rm "$c" "$name" >/dev/null
	rm -f "$tarball"
	buildah "${store[@]}" push --quiet "$name" "docker-archive:$tarball:$name" >/dev/null
	log "built $name into $tarball"
}

# The product image.
rootfs="$work/redirector"
busybox_root "$rootfs"
# jq and curl, and GNU stat, cmp and mount as on Debian (in /usr/bin, before busybox on PATH),
# so the image's tools are the Dockerfile's. (busybox stat names no bpffs, "UNKNOWN" for %T:
# redirector-node compares the magic number for that reason.)
with_libs "$rootfs" /usr/bin/jq /usr/bin/curl /usr/bin/stat /usr/bin/cmp /usr/bin/mount /bin/dash
# /bin/sh is dash, as on Debian: Debian's static busybox sh runs its own applets before PATH,
# which would bring busybox stat back.
ln -sfn dash "$rootfs/bin/sh"
mkdir -p "$rootfs/etc/ssl/certs" "$rootfs/usr/local/bin"
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/" 2>/dev/null || true
commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo "")
build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
(cd "$root" && CGO_ENABLED=0 go build -trimpath \
	-ldflags "-s -w -X main.version=$tag -X main.commit=$commit -X main.buildDate=$build_date" \
	-o "$rootfs/usr/local/bin/" ./cmd/redirector ./cmd/redirector-cni)
install -m 0755 "$root/manifests/image/redirector-node" "$rootfs/usr/local/bin/redirector-node"
commit "$rootfs" "localhost/redirector:$tag" "$out/redirector-$tag.tar" \
	--entrypoint '["/usr/local/bin/redirector"]' --cmd run --user 0:0 \
	--env PATH=/usr/local/bin:/usr/bin:/bin \
	--label org.opencontainers.image.title=redirector \
	--label "org.opencontainers.image.description=eBPF ambient-mesh node agent, CNI plugin and node script" \
	--label org.opencontainers.image.source=https://github.com/redirector-mesh/redirector

# The app image: a server with HTTP probes (httpd), and the tools of a client.
rootfs="$work/app"
busybox_root "$rootfs"
mkdir -p "$rootfs/www/cgi-bin"
echo ok >"$rootfs/www/healthz"
echo 'e2enode-plaintext-marker' >"$rootfs/www/index.html"
cat >"$rootfs/www/cgi-bin/ip" <<'CGI'
#!/bin/sh
printf 'Content-Type: text/plain\r\n\r\n%s\n' "$REMOTE_ADDR"
CGI
chmod 0755 "$rootfs/www/cgi-bin/ip"
commit "$rootfs" localhost/e2enode/app:1 "$out/app.tar" \
	--entrypoint '["/bin/httpd", "-f", "-p", "8080", "-h", "/www"]' --env PATH=/bin

rootfs="$work/pause"
mkdir -p "$rootfs"
(cd "$root" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$rootfs/pause" ./test/e2enode/pause)
commit "$rootfs" localhost/e2enode/pause:1 "$out/pause.tar" --entrypoint '["/pause"]'

echo "$out"
