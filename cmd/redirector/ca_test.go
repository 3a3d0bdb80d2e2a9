package main

import (
	"strings"
	"testing"
)

func TestCASettings(t *testing.T) {
	base := []string{"--node-name", "n1", "--source", "file:/tmp"}
	for _, tc := range []struct {
		args []string
		want string // error substring; empty: accepted
	}{
		{args: base, want: "--ca-address (CA_ADDRESS) (istiod) or, standalone, --ca-dir (CA_DIR) is required"},
		{args: append(base, "--ca-dir", "/x", "--ca-address", "istiod:15012"), want: "are exclusive"},
		{args: append(base, "--ca-address", "istiod:15012"), want: "--ca-root-cert (CA_ROOT_CERT) is required with --ca-address"},
		{args: append(base, "--ca-address", "istiod:15012", "--ca-root-cert", "/r", "--ca-root-cert-reload", "0s"), want: "--ca-root-cert-reload (CA_ROOT_CERT_RELOAD)"},
		{args: append(base, "--ca-address", "istiod:15012", "--ca-root-cert", "/r")},
		{args: append(base, "--ca-dir", "/x")},
	} {
		c, err := parseRunFlags(tc.args)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("parseRunFlags(%v): %v", tc.args, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("parseRunFlags(%v) = %v, want an error containing %q", tc.args, err, tc.want)
		case tc.want == "" && c.ca.addr != "" && (c.ca.clusterID != "Kubernetes" || c.ca.tokenFile == ""):
			t.Errorf("istiod defaults: %+v", c.ca)
		}
	}
}
