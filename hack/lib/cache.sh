# cache.sh: sourced by the hack/*-binaries.sh scripts (not run on its own). Each builds heavy
# test binaries into a cache folder keyed by a hash of its inputs (a tools module's go.mod and
# go.sum, ...), so a version bump builds into a new folder and an unchanged one is reused.
# The caller defines log (to stderr) and have (true when the binaries are in $out).

# cache_out PREFIX ARG FILE...: sets out to ARG, or else to the cache folder PREFIX<hash>
# (below ~/.cache/redirector), the hash of the FILEs' contents; with ARG --dir prints that
# folder and exits, building nothing.
cache_out() {
	local prefix=$1 arg=$2
	shift 2
	local hash
	hash=$(cat "$@" | sha256sum | cut -c1-16)
	out="${XDG_CACHE_HOME:-$HOME/.cache}/redirector/$prefix$hash"
	if [[ "$arg" == --dir ]]; then
		echo "$out"
		exit 0
	fi
	out=${arg:-$out}
}

# cache_build_lock: prints $out and exits when have finds the binaries there; else takes the
# folder's lock, so that concurrent test binaries asking at once build once (the others wait
# for it, then find them present), and makes tmp, a build folder inside $out removed at exit:
# binaries are built there and moved into place, so an interrupted build never leaves a
# half-written one that have would accept.
cache_build_lock() {
	if have; then
		log "up to date in $out"
		echo "$out"
		exit 0
	fi
	mkdir -p "$out"
	exec 9>"$out/.lock"
	flock 9
	if have; then
		log "built by another process in $out"
		echo "$out"
		exit 0
	fi
	tmp=$(mktemp -d "$out/.build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
}
