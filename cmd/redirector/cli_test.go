package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
)

// TestMain lets the CLI tests run this test binary as the real command
// (exit code, stdout and stderr included): with REDIRECTOR_RUN_MAIN=1 it is
// `redirector` and its arguments follow "--".
func TestMain(m *testing.M) {
	if os.Getenv("REDIRECTOR_RUN_MAIN") == "1" {
		for i, a := range os.Args {
			if a == "--" {
				os.Args = append([]string{"redirector"}, os.Args[i+1:]...)
				break
			}
		}
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// cli runs the command with args and env; it returns stdout, stderr and
// the exit code.
func cli(t *testing.T, env []string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.CommandContext(context.Background(), os.Args[0], append([]string{"-test.run=^$", "--"}, args...)...)
	cmd.Env = append(append(os.Environ(), "REDIRECTOR_RUN_MAIN=1"), env...)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return stdout.String(), stderr.String(), code
}

// TestHelpExitsZero: every command's -h prints its help on stdout and
// exits 0, including inspect and ca, whose first argument is a target.
func TestHelpExitsZero(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"-h"}, []string{"redirector run", "redirector inspect"}},
		{[]string{"inspect", "-h"}, []string{"redirector inspect pods|maps|workloads", "-o string", "-admin-addr host:port"}},
		{[]string{"inspect", "--help"}, []string{"redirector inspect pods|maps"}},
		{[]string{"inspect", "pods", "-h"}, []string{"-bpf-root string"}},
		{[]string{"ca", "-h"}, []string{"redirector ca init", "-dir string", "-trust-domain string"}},
		{[]string{"ca", "init", "-h"}, []string{"-trust-domain string"}},
		{[]string{"run", "-h"}, []string{"-metrics-addr host:port", "-cert-ttl duration", "-pool-max-streams int", "-access-log bool", "(env METRICS_ADDR, default \":15020\")"}},
		{[]string{"uninstall", "-h"}, []string{"-bpf-root string"}},
	} {
		stdout, stderr, code := cli(t, nil, tc.args...)
		if code != 0 {
			t.Errorf("redirector %v: exit %d, want 0; stderr %s", tc.args, code, stderr)
		}
		for _, w := range tc.want {
			if !strings.Contains(stdout, w) {
				t.Errorf("redirector %v: help lacks %q:\n%s", tc.args, w, stdout)
			}
		}
	}
}

// TestCLIErrors: wrong invocations exit 1 with an error naming what was
// wrong: an extra positional argument, an address that is not host:port
// (named by flag and env variable), an unknown ca command.
func TestCLIErrors(t *testing.T) {
	run := []string{"run", "--node-name", "n1", "--source", "file:/tmp", "--ca-dir", "/tmp"}
	xds := []string{"run", "--node-name", "n1", "--source", "xds", "--ca-address", "istiod:15012", "--ca-root-cert", "/tmp/root.pem", "--pod-name", "p", "--instance-ip", "10.0.0.1"}
	for _, tc := range []struct {
		env  []string
		args []string
		want string
	}{
		{nil, []string{"inspect", "pods", "extra"}, `unexpected argument "extra"`},
		{nil, []string{"inspect", "pods", "-o", "json", "extra"}, `unexpected argument "extra"`},
		{nil, []string{"uninstall", "now"}, `unexpected argument "now"`},
		{nil, []string{"version", "--short"}, "flag provided but not defined: -short"},
		{nil, []string{"version", "x"}, `unexpected argument "x"`},
		{nil, append(run, "stray"), `unexpected argument "stray"`},
		{nil, []string{"ca", "init", "--dir", "/nonexistent/x", "y"}, `unexpected argument "y"`},
		{nil, []string{"ca", "make"}, `unknown ca command "make"`},
		{nil, []string{"ca"}, "usage: redirector ca init"},
		{nil, []string{"inspect"}, "usage: redirector inspect"},
		{nil, append(run, "--metrics-addr", "15020"), `--metrics-addr (METRICS_ADDR): "15020" is not host:port`},
		{[]string{"READINESS_ADDR=:http"}, run, `--readiness-addr (READINESS_ADDR): ":http" is not host:port: port "http" is not a number`},
		{[]string{"ADMIN_ADDR=127.0.0.1:99999"}, run, `--admin-addr (ADMIN_ADDR): "127.0.0.1:99999" is not host:port`},
		{nil, append(run, "--ca-address", "istiod.istio-system.svc"), `--ca-address (CA_ADDRESS): "istiod.istio-system.svc" is not host:port`},
		{[]string{"XDS_ADDRESS=::1:15010"}, run, `--xds-address (XDS_ADDRESS): "::1:15010" is not host:port`},
		{[]string{"NETWORK=east west"}, xds, `--network (NETWORK): "east west" is not a network name`},
		{nil, []string{"inspect", "certs", "--admin-addr", "localhost"}, `--admin-addr (ADMIN_ADDR): "localhost" is not host:port`},
		{[]string{"BPF_ROOT=/sys/fs/bpf/../x"}, []string{"inspect", "pods"}, `--bpf-root (BPF_ROOT): "/sys/fs/bpf/../x" is not an absolute, clean path`},
	} {
		_, stderr, code := cli(t, tc.env, tc.args...)
		if code != 1 || !strings.Contains(stderr, tc.want) {
			t.Errorf("redirector %v (env %v): exit %d, stderr %q; want exit 1 and %q", tc.args, tc.env, code, stderr, tc.want)
		}
	}
}

// TestAddressesAccepted: the address forms the chart and users write pass.
func TestAddressesAccepted(t *testing.T) {
	for _, a := range []string{":15020", "0.0.0.0:15020", "[::]:15021", "127.0.0.1:0", "[fd00::1]:15000", "istiod.istio-system.svc:15012", "localhost:15000"} {
		if err := checkAddr(a); err != nil {
			t.Errorf("checkAddr(%q) = %v", a, err)
		}
	}
}

// TestOutputFlagIgnoresOUTPUTEnv: -o has no env twin, so OUTPUT=bogus in the
// shell does not change (or break) inspect's output format.
func TestOutputFlagIgnoresOUTPUTEnv(t *testing.T) {
	_, stderr, code := cli(t, []string{"OUTPUT=bogus"}, "inspect", "pods", "--bpf-root", t.TempDir())
	if strings.Contains(stderr, "bogus") {
		t.Errorf("OUTPUT=bogus reached inspect's -o: exit %d, %s", code, stderr)
	}
	_, stderr, code = cli(t, nil, "inspect", "pods", "-o", "bogus")
	if code != 1 || !strings.Contains(stderr, `-o: unknown output format "bogus"`) {
		t.Errorf("-o bogus: exit %d, stderr %q", code, stderr)
	}
}

// TestVersion: version, commit, build date and Go version, from -ldflags.
func TestVersion(t *testing.T) {
	stdout, stderr, code := cli(t, nil, "version")
	if code != 0 || !strings.Contains(stdout, "redirector dev") || !strings.Contains(stdout, runtime.Version()) ||
		!strings.Contains(stdout, "commit:") || !strings.Contains(stdout, "built:") {
		t.Errorf("version: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	bin := t.TempDir() + "/redirector"
	ld := "-X main.version=v1.2.3 -X main.commit=0123abc -X main.buildDate=2026-12-01T10:00:00Z"
	if out, err := exec.Command("go", "build", "-ldflags", ld, "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v: %s", err, out)
	}
	out, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"redirector v1.2.3", "commit:     0123abc", "built:      2026-12-01T10:00:00Z", "go:         " + runtime.Version()} {
		if !strings.Contains(string(out), w) {
			t.Errorf("version output lacks %q:\n%s", w, out)
		}
	}
}
