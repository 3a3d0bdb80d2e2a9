# redirector: eBPF ambient-mesh node agent. `make help` lists the targets.

SHELL   := /bin/bash
GO      ?= go
export PATH := $(PATH):/usr/local/go/bin
BIN     := bin
PKGS    := ./...
DEBS    := clang llvm libbpf-dev bpftool iproute2 iperf3 curl jq util-linux ca-certificates git make bind9-dnsutils dnsmasq-base openssl nghttp2-client
# FUZZTIME counts executions, not seconds: a duration limit races Go's fuzz
# coordinator at its deadline and can fail with a bare "context deadline exceeded"
# (golang/go#75804; seen here in CI with no crasher saved).
FUZZTIME ?= 30000x
# Fuzzers whose every input costs a TLS handshake and timers (some 15 a second
# here) get FUZZTIME_SLOW instead; run them longer by hand.
FUZZ_SLOW ?= FuzzClientResponse
FUZZTIME_SLOW ?= 300x
# Each new interesting input is minimized for this many executions (Go's
# default is 60 s of them, which the slow fuzzers spend on every one).
FUZZMINIMIZE ?= 200x
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
COMMIT  ?= $(shell git rev-parse HEAD 2>/dev/null)
BUILD_DATE ?= $(shell date -u +%Y-%m-%dT%H:%M:%SZ)
LDFLAGS := -X main.version=$(VERSION) -X main.commit=$(COMMIT) -X main.buildDate=$(BUILD_DATE)

.DEFAULT_GOAL := help

## help: list the targets
.PHONY: help
help:
	@awk '/^## /{sub(/^## /,""); i=index($$0,": "); printf "  %-12s %s\n", substr($$0,1,i-1), substr($$0,i+2)}' $(MAKEFILE_LIST)

## deps: install the Debian packages the build, tests and demo need (idempotent)
.PHONY: deps
deps:
	@missing=$$(for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing:" $$missing; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "deps: all installed"; fi
	@$(GO) version

## generate: compile the BPF C programs and regenerate the bpf2go Go bindings
.PHONY: generate
generate:
	$(GO) generate ./bpf/...

## gen-check: fail if the committed bpf2go output differs from a fresh generate
.PHONY: gen-check
gen-check: generate
	@git diff --exit-code --stat -- bpf/ || { echo "bpf2go output is stale: run make generate and commit"; exit 1; }

## build: build redirector and redirector-cni into bin/
.PHONY: build
build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/...

## demo: build, then run the embedded default: two simulated nodes, real agents, real traffic (root)
.PHONY: demo
demo: deps build
	./$(BIN)/redirector-demo

## lint: gofmt and go vet
.PHONY: lint
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); [ -z "$$out" ] || { echo "gofmt needed:"; echo "$$out"; exit 1; }
	$(GO) vet $(PKGS)

## test-unit: tests that need no root
.PHONY: test-unit
test-unit:
	$(GO) test -count=1 -short $(PKGS)

## test-race: the race detector over the packages with the most concurrency (tunnel, policy, sources, identity, node agent, admin endpoints)
RACE_PKGS := ./pkg/tunnel/... ./pkg/policy/... ./pkg/source/... ./pkg/identity/... ./pkg/nodeagent/... ./pkg/admin/...
.PHONY: test-race
test-race:
	$(GO) test -race -count=1 -timeout 20m $(RACE_PKGS)

## test-deps: build the test kube-apiserver/etcd, istiod, istioctl, h2spec, the reference CNI plugins and the real node's kubelet, controller-manager, scheduler, kubectl and helm (cached by content hash; installs the node's Debian packages)
.PHONY: test-deps
test-deps:
	@bash hack/k8s-binaries.sh >/dev/null
	@bash hack/node-binaries.sh >/dev/null
	@bash hack/cni-plugins.sh >/dev/null
	@bash hack/istio-binaries.sh >/dev/null
	@bash hack/istio-binaries.sh istioctl >/dev/null
	@bash hack/h2spec.sh >/dev/null

## test: everything CI runs, as root: lint, gen-check, all tests (privileged, e2e and the real node), short fuzzing
.PHONY: test
test: deps lint gen-check build test-deps
	@mkdir -p $(BIN); : > $(BIN)/test.log
	@for mod in . manifests test/dashboard bench; do \
		echo "== go test in $$mod"; \
		set -o pipefail; (cd $$mod && $(GO) test -v -count=1 -timeout 25m ./... 2>&1) | tee -a $(BIN)/test.log | grep -E '^(=== RUN|--- |ok|FAIL|panic)|_test.go:[0-9]+:' \
			|| { echo "tests failed; the failures in full (all output: $(BIN)/test.log):"; grep -A80 -- '--- FAIL' $(BIN)/test.log | head -600; exit 1; }; \
	done
	@if grep -q -- '--- SKIP' $(BIN)/test.log; then echo "tests were skipped; CI must run every test:"; grep -- '--- SKIP' $(BIN)/test.log; exit 1; fi
	@echo "tests run: $$(grep -c -- '--- PASS' $(BIN)/test.log) passed, 0 skipped"
	@echo "== go test -race"; $(MAKE) --no-print-directory test-race
	@echo "== make e2e-node"; $(MAKE) --no-print-directory e2e-node
	cd test/cniplugins && $(GO) vet ./...
	cd manifests && $(GO) vet ./...
	cd bench && $(GO) vet ./...
	$(MAKE) --no-print-directory bench-smoke
	@for target in $$(grep -rl --include='*_test.go' '^func Fuzz' pkg cmd bpf 2>/dev/null | xargs -r dirname | sort -u); do \
		for fn in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$target/*_test.go | sed 's/func //'); do \
			n=$(FUZZTIME); case " $(FUZZ_SLOW) " in *" $$fn "*) n=$(FUZZTIME_SLOW);; esac; \
			echo "fuzz $$target $$fn ($$n)"; \
			$(GO) test -run='^$$' -fuzz="^$$fn$$" -fuzztime=$$n -fuzzminimizetime=$(FUZZMINIMIZE) ./$$target || exit 1; \
		done; \
	done

## e2e-node: a real node (kubelet, containerd, control plane) in its own netns; the chart installed with helm (file CA, and istiod's CA and xDS), pods meshed (root; part of test)
# The test's steps give up 2 min before -timeout and a watchdog stops the nodes 45 s before
# it (the testing package's -timeout panic would run no clean-up); it fails if any test is
# skipped. Its whole output: $(BIN)/e2e-node.log.
NODE_DEBS := containerd runc containernetworking-plugins buildah busybox-static iptables
E2ENODE_TIMEOUT ?= 12m
.PHONY: e2e-node
e2e-node:
	@$(MAKE) --no-print-directory deps DEBS="$(DEBS) $(NODE_DEBS)"
	@bash hack/node-binaries.sh >/dev/null
	@bash hack/istio-binaries.sh >/dev/null
	@mkdir -p $(BIN)
	$(GO) vet -tags e2enode ./test/e2enode/
	@set -o pipefail; $(GO) test -tags e2enode -count=1 -v -timeout $(E2ENODE_TIMEOUT) ./test/e2enode/ 2>&1 | tee $(BIN)/e2e-node.log \
		| grep -E '^(=== RUN|\s*--- |ok|FAIL|panic|e2enode:)|_test.go:[0-9]+:' \
		|| { echo "e2e-node failed; the failures in full (all output: $(BIN)/e2e-node.log):"; grep -B2 -A80 -- '--- FAIL' $(BIN)/e2e-node.log | head -400; exit 1; }
	@if grep -q -- '--- SKIP' $(BIN)/e2e-node.log; then echo "e2e-node tests were skipped; CI must run every test:"; grep -- '--- SKIP' $(BIN)/e2e-node.log; exit 1; fi
	@echo "e2e-node: $$(grep -c -- '--- PASS' $(BIN)/e2e-node.log) passed, 0 skipped"

## clean: remove build output
.PHONY: clean
clean:
	rm -rf $(BIN)

## bench: mesh benchmark suite as root: direct vs meshed vs capture-only vs iptables TPROXY vs stunnel and HAProxy mTLS peers, plus Go microbenchmarks and the churn soak (BENCH_QUICK=1: ~2 min, no soak)
.PHONY: bench
bench: build
	@$(MAKE) --no-print-directory deps DEBS="$(DEBS) iptables stunnel4 haproxy"
	@cache=$${XDG_CACHE_HOME:-$$HOME/.cache}/redirector-bench; mkdir -p $$cache && \
	cd bench && $(GO) build -o ../$(BIN)/meshbench ./cmd/meshbench && $(GO) build -o $$cache/fortio fortio.org/fortio && cd .. && \
	./$(BIN)/meshbench --bin $(BIN) --fortio $$cache/fortio --out bench/results $(if $(BENCH_QUICK),--quick) $(BENCH_FLAGS)
	$(if $(BENCH_QUICK),,@$(MAKE) --no-print-directory soak)

## soak: as root, pods come and go under meshed traffic for SOAK (default 5m; CI runs 75s); every agent resource back to its baseline
.PHONY: soak
soak:
	SOAK=$(or $(SOAK),5m) $(GO) test -count=1 -timeout 30m -run '^TestChurnSoak$$' -v ./test/netns/

## bench-smoke: one short round of the benchmark suite (about a minute); fails unless every variant produced numbers
.PHONY: bench-smoke
bench-smoke: build
	@$(MAKE) --no-print-directory deps DEBS="$(DEBS) iptables stunnel4 haproxy"
	@cache=$${XDG_CACHE_HOME:-$$HOME/.cache}/redirector-bench; mkdir -p $$cache && \
	cd bench && $(GO) build -o ../$(BIN)/meshbench ./cmd/meshbench && $(GO) build -o $$cache/fortio fortio.org/fortio && cd .. && \
	./$(BIN)/meshbench --bin $(BIN) --fortio $$cache/fortio --out $(BIN)/bench-smoke --quick --runs 1 --strict \
		--iperf-time 1s --http-time 1s --http-max-time 1s --cps-time 500ms --rr-count 300 --idle-conns 20 --profile-time=-1s --micro=false
