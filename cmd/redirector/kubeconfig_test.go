package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/internal/smallfile/smallfiletest"
	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// TestKubeconfigBounded: the file KUBECONFIG names is read through
// smallfile. A fifo there fails at once naming the path (BuildConfigFromFlags
// blocked on it for ever); an outsized file is refused naming the limit; a
// kubeconfig's relative file references are still taken from its directory.
func TestKubeconfigBounded(t *testing.T) {
	dir := t.TempDir()
	fifo := smallfiletest.Fifo(t, filepath.Join(dir, "fifo"))
	err := waitfor.Returns(t, "restConfig(fifo)", func() error { _, err := restConfig(fifo); return err })
	if err == nil || !strings.Contains(err.Error(), "--kubeconfig (KUBECONFIG): "+fifo+" is not a regular file (a fifo)") {
		t.Errorf("restConfig(fifo) = %v, want an error naming the fifo", err)
	}

	big := smallfiletest.Oversized(t, filepath.Join(dir, "big"), maxKubeconfigBytes+1)
	if _, err := restConfig(big); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%s has %d bytes, more than the %d read", big, maxKubeconfigBytes+1, maxKubeconfigBytes)) {
		t.Errorf("restConfig(big) = %v, want an error naming the limit", err)
	}

	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := restConfig(empty); err == nil || !strings.Contains(err.Error(), empty) {
		t.Errorf("restConfig(empty) = %v, want an error naming the file", err)
	}

	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), []byte("not checked here"), 0o600); err != nil {
		t.Fatal(err)
	}
	ok := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(ok, []byte(`apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority: ca.crt
users:
- name: u
  user:
    token: t0ken
contexts:
- name: x
  context: {cluster: c, user: u}
current-context: x
`), 0o600); err != nil {
		t.Fatal(err)
	}
	rc, err := restConfig(ok)
	if err != nil {
		t.Fatalf("restConfig(ok): %v", err)
	}
	if rc.Host != "https://127.0.0.1:6443" || rc.BearerToken != "t0ken" || rc.TLSClientConfig.CAFile != filepath.Join(dir, "ca.crt") {
		t.Errorf("restConfig(ok) = host %q, token %q, CA file %q; want the kubeconfig's, CA file in its directory", rc.Host, rc.BearerToken, rc.TLSClientConfig.CAFile)
	}
}

// TestKubeconfigNamedFilesBounded: the files a kubeconfig names (CA, client
// certificate and key, token file) are checked as the kubeconfig is: a fifo
// or an outsized file among them is an error at start naming the field and
// the file, where client-go's own read would block or fill the memory.
func TestKubeconfigNamedFilesBounded(t *testing.T) {
	dir := t.TempDir()
	fifo := smallfiletest.Fifo(t, filepath.Join(dir, "fifo"))
	big := smallfiletest.Oversized(t, filepath.Join(dir, "big"), maxKubeconfigBytes+1)
	for _, c := range []struct{ cluster, user, want string }{
		{"certificate-authority: fifo", "token: t0ken", "certificate-authority: " + fifo + " is not a regular file (a fifo)"},
		{"insecure-skip-tls-verify: true", "tokenFile: fifo", "tokenFile: " + fifo + " is not a regular file (a fifo)"},
		{"insecure-skip-tls-verify: true", "{client-certificate: big, client-key: big}", "client-certificate: " + big + " has"},
	} {
		path := filepath.Join(dir, "kubeconfig")
		config := "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:6443\n    " + c.cluster +
			"\nusers:\n- name: u\n  user: " + c.user + "\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n"
		if c.user == "token: t0ken" || c.user == "tokenFile: fifo" {
			config = strings.Replace(config, "  user: "+c.user, "  user:\n    "+c.user, 1)
		}
		if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
			t.Fatal(err)
		}
		err := waitfor.Returns(t, "restConfig naming "+c.want, func() error { _, err := restConfig(path); return err })
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("restConfig = %v, want an error with %q", err, c.want)
		}
	}
}
