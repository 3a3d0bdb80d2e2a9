// Package manifests holds how redirector is packaged and installed: the Helm chart
// (charts/redirector), the node script shipped in the image (image/redirector-node) and the
// tests of both, and of the repository's Dockerfile.
//
// It is a module of its own so that Helm's and BuildKit's dependencies never enter the
// agent's go.mod. Run its tests with `cd manifests && go test ./...`.
package manifests
