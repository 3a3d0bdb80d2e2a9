// Package e2enode runs the product on a real Kubernetes node: etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler, containerd and a kubelet, all inside one network
// namespace of their own (the node's "host network") and one mount namespace of their own, so
// that the machine's forwarding, routes, iptables and mounts are never touched. The agent is
// installed with the Helm chart from a locally built image (hack/build-image.sh); workload
// pods run locally built busybox images.
//
// The tests carry the build tag e2enode: they run with `make e2e-node`, not as part of
// `go test ./...`. They need root, the binaries of hack/node-binaries.sh and the Debian
// packages containerd, runc, containernetworking-plugins, buildah and busybox-static.
// See docs/e2e-node.md.
package e2enode
