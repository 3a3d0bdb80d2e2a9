package main

import (
	"fmt"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/redirector-mesh/redirector/internal/smallfile"
)

// maxKubeconfigBytes bounds the read of the file KUBECONFIG names: a fifo,
// a device or an outsized file there is an error at start, not a read that
// blocks the agent for ever or fills its memory. A kubeconfig holds a few
// clusters and users with their certificates inline: kilobytes, not
// megabytes.
const maxKubeconfigBytes = 4 << 20

// restConfig is the API client configuration: from the kubeconfig file
// when one is named, else the in-cluster service account.
func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		rc, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("kubernetes client config (in-cluster): %w", err)
		}
		return rc, nil
	}
	rc, err := kubeconfigRESTConfig(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--kubeconfig (KUBECONFIG): %w", err)
	}
	return rc, nil
}

// kubeconfigRESTConfig reads the kubeconfig at path through smallfile and
// builds the client configuration as clientcmd.BuildConfigFromFlags did
// from the path: files the kubeconfig names by a relative path (a CA, a
// client certificate) are taken relative to its directory. One difference:
// an empty kubeconfig is an error, where BuildConfigFromFlags fell back to
// the in-cluster configuration.
func kubeconfigRESTConfig(path string) (*rest.Config, error) {
	data, err := smallfile.Read(path, maxKubeconfigBytes)
	if err != nil {
		return nil, err
	}
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", path, err)
	}
	for _, c := range cfg.Clusters {
		c.LocationOfOrigin = path
	}
	for _, a := range cfg.AuthInfos {
		a.LocationOfOrigin = path
	}
	for _, c := range cfg.Contexts {
		c.LocationOfOrigin = path
	}
	if err := clientcmd.ResolveLocalPaths(cfg); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if err := checkNamedFiles(cfg); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	rc, err := clientcmd.NewNonInteractiveClientConfig(*cfg, "", &clientcmd.ConfigOverrides{}, nil).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return rc, nil
}

// checkNamedFiles reads the files the current context names, as smallfile
// does, before client-go opens them with no bound (its validation, its
// transport, and the token file again every minute): a fifo or an outsized
// file there is an error at start, naming it, not an open or a read that
// blocks. The paths stay in the configuration, so client-go still reloads
// a rotated token. Other contexts are not used, and not checked.
func checkNamedFiles(cfg *clientcmdapi.Config) error {
	cur := cfg.Contexts[cfg.CurrentContext]
	if cur == nil {
		return nil // clientcmd says what is wrong
	}
	var cluster clientcmdapi.Cluster
	var user clientcmdapi.AuthInfo
	if c := cfg.Clusters[cur.Cluster]; c != nil {
		cluster = *c
	}
	if u := cfg.AuthInfos[cur.AuthInfo]; u != nil {
		user = *u
	}
	for _, f := range []struct{ field, path string }{
		{"certificate-authority", cluster.CertificateAuthority},
		{"client-certificate", user.ClientCertificate},
		{"client-key", user.ClientKey},
		{"tokenFile", user.TokenFile},
	} {
		if f.path == "" {
			continue
		}
		if _, err := smallfile.Read(f.path, maxKubeconfigBytes); err != nil {
			return fmt.Errorf("%s: %w", f.field, err)
		}
	}
	return nil
}
