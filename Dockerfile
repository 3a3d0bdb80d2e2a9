# syntax=docker/dockerfile:1
#
# The redirector image: the node agent, the chained CNI plugin redirector-cni and the node
# script redirector-node (manifests/image) that the Helm chart runs next to the agent.
#
#   docker build -t redirector:dev --build-arg VERSION=$(git describe --always) .
#   docker buildx build --platform linux/amd64,linux/arm64 -t REPO:TAG --push .

ARG GO_VERSION=1.26
ARG DEBIAN_RELEASE=trixie

# Build stage: static Go binaries. CGO_ENABLED=0 needs no libc at run time, and no clang at
# build time either: the eBPF objects are bpf2go output committed under bpf/ and embedded.
# It runs on the build machine's platform and cross-compiles for the target's.
FROM --platform=$BUILDPLATFORM golang:${GO_VERSION}-${DEBIAN_RELEASE} AS build
ARG TARGETOS
ARG TARGETARCH
ARG VERSION=dev
# COMMIT and BUILD_DATE show in `redirector version` (docker build --build-arg COMMIT=$(git rev-parse HEAD) ...).
ARG COMMIT=""
ARG BUILD_DATE=""
ENV CGO_ENABLED=0
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    GOOS=$TARGETOS GOARCH=$TARGETARCH \
    go build -trimpath -ldflags "-s -w -X main.version=${VERSION} -X main.commit=${COMMIT} -X main.buildDate=${BUILD_DATE}" -o /out/ \
        ./cmd/redirector ./cmd/redirector-cni

# Final stage: debian-slim rather than distroless/static. The binaries alone would run on
# distroless, but the pod also runs redirector-node, a shell script that needs sh, jq (to
# edit the CNI conflist), curl (to ask the API server whether its DaemonSet is being
# deleted), stat, cmp and mount.
#
# It runs as root (uid 0), on purpose: the agent needs NET_ADMIN, SYS_ADMIN, BPF, SYS_PTRACE
# and DAC_OVERRIDE, and Kubernetes grants added capabilities only to uid 0 (there are no
# ambient capabilities for a non-root user). The chart drops every other capability.
FROM debian:${DEBIAN_RELEASE}-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends jq curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/redirector /out/redirector-cni /usr/local/bin/
COPY --chmod=0755 manifests/image/redirector-node /usr/local/bin/redirector-node
LABEL org.opencontainers.image.title="redirector" \
      org.opencontainers.image.description="eBPF ambient-mesh node agent, CNI plugin and node script" \
      org.opencontainers.image.source="https://github.com/redirector-mesh/redirector"
USER 0:0
ENTRYPOINT ["/usr/local/bin/redirector"]
CMD ["run"]
