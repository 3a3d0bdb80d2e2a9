package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

func TestRunSettingsErrorsNameTheSetting(t *testing.T) {
	base := []string{"--node-name", "n1", "--source", "file:/tmp", "--ca-dir", "/tmp"}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{args: []string{"--source", "file:/x", "--ca-dir", "/x"}, want: "--node-name (NODE_NAME) is required"},
		{args: []string{"--node-name", "n", "--ca-dir", "/x"}, want: "--source (SOURCE) is required"},
		{args: append(base, "--source", "etcd"), want: `--source (SOURCE): "etcd" is neither file:PATH nor kubernetes`},
		{args: append(base, "--trust-domain", "Bad_Domain"), want: "--trust-domain (TRUST_DOMAIN)"},
		{args: append(base, "--cert-ttl", "5"), want: `--cert-ttl (CERT_TTL): "5" is not a positive duration`},
		{args: append(base, "--cert-ttl", "30s"), want: "--cert-ttl (CERT_TTL): 30s is shorter than the 2m minimum"},
		{args: append(base, "--reconcile-period", "-1s"), want: "--reconcile-period (RECONCILE_PERIOD)"},
		{args: append(base, "--pool-max-streams", "0"), want: "--pool-max-streams (POOL_MAX_STREAMS)"},
		{args: append(base, "--pool-conns-per-key", "17"), want: `--pool-conns-per-key (POOL_CONNS_PER_KEY): "17" is not an integer from 1 to 16`},
		{args: base, env: map[string]string{"POOL_CONNS_PER_KEY": "two"}, want: `--pool-conns-per-key (POOL_CONNS_PER_KEY): "two" is not an integer from 1 to 16`},
		{args: append(base, "--hbone-congestion-control", "nosuch"), want: `--hbone-congestion-control (HBONE_CONGESTION_CONTROL): congestion control "nosuch"`},
		{args: append(base, "--tc-attach", "xdp"), want: "--tc-attach (TC_ATTACH)"},
		{args: append(base, "--log-level", "loud"), want: "--log-level (LOG_LEVEL)"},
		{args: append(base, "--exclude-namespaces", "kube-system,Not_A_Label"), want: "EXCLUDE_NAMESPACES"},
		{args: base, env: map[string]string{"HOST_PROBE_SNAT_IP": "10.0.0.1"}, want: "HOST_PROBE_SNAT_IP=10.0.0.1 must be an IPv4 address inside 169.254.0.0/16"},
		{args: base, env: map[string]string{"HOST_PROBE_SNAT_IPV6": "not-an-ip"}, want: `HOST_PROBE_SNAT_IPV6="not-an-ip" is not an IP address`},
	} {
		for k, v := range tc.env {
			t.Setenv(k, v)
		}
		_, err := parseRunFlags(tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseRunFlags(%v, env %v) = %v, want an error containing %q", tc.args, tc.env, err, tc.want)
		}
		for k := range tc.env {
			os.Unsetenv(k)
		}
	}
}

func TestRunSettingsFlagBeatsEnv(t *testing.T) {
	t.Setenv("LOG_LEVEL", "debug")
	t.Setenv("NODE_NAME", "from-env")
	cfg, err := parseRunFlags([]string{"--source", "file:/tmp", "--ca-dir", "/tmp", "--log-level", "warn", "--host-probe-snat-ip", "169.254.1.2"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.node != "from-env" || cfg.logLevel.String() != "WARN" || cfg.data.ProbeSNATv4.String() != "169.254.1.2" {
		t.Errorf("got node %q level %s probe %s", cfg.node, cfg.logLevel, cfg.data.ProbeSNATv4)
	}
	if len(cfg.selection.ExcludeNamespaces) != 1 || cfg.selection.ExcludeNamespaces[0] != "kube-system" {
		t.Errorf("default excluded namespaces %v, want [kube-system]", cfg.selection.ExcludeNamespaces)
	}
}

// TestREADMEListsEverySetting keeps the README's settings table complete.
func TestREADMEListsEverySetting(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	s, _ := runSettings()
	for _, st := range s.list {
		row := regexp.MustCompile("(?m)^\\| `" + st.env + "` ")
		if !row.Match(readme) {
			t.Errorf("README.md settings table has no row for %s (--%s)", st.env, st.flag)
		}
	}
}
