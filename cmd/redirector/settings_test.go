package main

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
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
		{args: append(base, "--cert-ttl", "30s"), want: "--cert-ttl (CERT_TTL): 30s is not from the 2m minimum to the 8760h0m0s maximum"},
		{args: append(base, "--cert-ttl", "876000h"), want: "--cert-ttl (CERT_TTL): 876000h0m0s is not from the 2m minimum to the 8760h0m0s maximum"},
		{args: append(base, "--reply-poll-cpu", "7"), want: `--reply-poll-cpu (REPLY_POLL_CPU): "7" is not a share of one CPU`},
		{args: append(base, "--reply-poll-cpu", "NaN"), want: `--reply-poll-cpu (REPLY_POLL_CPU): "NaN" is not a share of one CPU`},
		{args: append(base, "--reconcile-period", "-1s"), want: "--reconcile-period (RECONCILE_PERIOD)"},
		{args: append(base, "--pool-max-streams", "0"), want: "--pool-max-streams (POOL_MAX_STREAMS)"},
		{args: append(base, "--pool-conns-per-key", "17"), want: `--pool-conns-per-key (POOL_CONNS_PER_KEY): "17" is not an integer from 1 to 16`},
		{args: base, env: map[string]string{"POOL_CONNS_PER_KEY": "two"}, want: `--pool-conns-per-key (POOL_CONNS_PER_KEY): "two" is not an integer from 1 to 16`},
		{args: append(base, "--hbone-congestion-control", "nosuch"), want: `--hbone-congestion-control (HBONE_CONGESTION_CONTROL): congestion control "nosuch"`},
		{args: append(base, "--tc-attach", "xdp"), want: "--tc-attach (TC_ATTACH)"},
		{args: append(base, "--dns-capture", "yes"), want: `--dns-capture (DNS_CAPTURE): "yes" is not true or false`},
		{args: append(base, "--dns-upstreams", "10.96.0.10,kube-dns"), want: `--dns-upstreams (DNS_UPSTREAMS): resolver "kube-dns" is not an IP address or IP:port`},
		{args: base, env: map[string]string{"DNS_UPSTREAMS": "10.96.0.10:0"}, want: `--dns-upstreams (DNS_UPSTREAMS): resolver "10.96.0.10:0" is not an IP address or IP:port`},
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

// TestRunSettingsNamesAreValidated: a setting that names something (the
// node, a namespace, a pod, the cluster) and cannot be such a name fails
// at start, naming the setting. Before, they were taken as given: a
// ROOT_NAMESPACE of "istio-system " (a stray space, or a newline from a
// file) matched no namespace, so the mesh-wide PeerAuthentication and
// AuthorizationPolicies of istio-system applied nowhere and a STRICT mesh
// took plaintext; a NODE_NAME with a space enrolled nothing; an invalid
// POD_NAMESPACE was reported as EXCLUDE_NAMESPACES.
func TestRunSettingsNamesAreValidated(t *testing.T) {
	base := []string{"--node-name", "n1", "--source", "file:/tmp", "--ca-dir", "/tmp"}
	xds := []string{"--node-name", "n1", "--source", "xds", "--ca-address", "istiod:15012", "--ca-root-cert", "/x", "--pod-name", "ztunnel-1", "--instance-ip", "10.0.0.9"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{args: append(base, "--root-namespace", "istio-system "), want: `--root-namespace (ROOT_NAMESPACE): "istio-system " is not a namespace name`},
		{args: append(base, "--root-namespace", "Istio-System"), want: `--root-namespace (ROOT_NAMESPACE): "Istio-System" is not a namespace name`},
		{args: append(base, "--root-namespace", ""), want: `--root-namespace (ROOT_NAMESPACE): "" is not a namespace name`},
		{args: append(base, "--node-name", "node-a\n"), want: `--node-name (NODE_NAME): "node-a\n" is not a node name`},
		{args: append(base, "--node-name", "Node_A"), want: `--node-name (NODE_NAME): "Node_A" is not a node name`},
		{args: append(base, "--pod-namespace", "Istio_System"), want: `--pod-namespace (POD_NAMESPACE): "Istio_System" is not a namespace name`},
		{args: append(xds, "--pod-name", "ztunnel~1"), want: `--pod-name (POD_NAME): "ztunnel~1" is not a pod name`},
		{args: append(base, "--cluster-id", "cluster1 "), want: `--cluster-id (CLUSTER_ID): "cluster1 " is not a cluster name (a label value)`},
		{args: append(base, "--cluster-id", "clüster"), want: `--cluster-id (CLUSTER_ID): "clüster" is not a cluster name`},
		{args: append(base, "--cluster-id", "c\x01"), want: `--cluster-id (CLUSTER_ID): "c\x01" is not a cluster name`},
		{args: append(base, "--cluster-id", strings.Repeat("c", 64)), want: `is not a cluster name`},
		{args: append(xds, "--instance-ip", "::ffff:10.0.0.9"), want: `--instance-ip (INSTANCE_IP): "::ffff:10.0.0.9" is not a pod address`},
		{args: append(xds, "--instance-ip", "fe80::1%eth0"), want: `--instance-ip (INSTANCE_IP): "fe80::1%eth0" is not a pod address`},
		{args: append(xds, "--instance-ip", "0.0.0.0"), want: `--instance-ip (INSTANCE_IP): "0.0.0.0" is not a pod address`},
		{args: append(base, "--cni-socket", "run/cni.sock"), want: `--cni-socket (CNI_SOCKET): "run/cni.sock" is not an absolute, clean path`},
		{args: append(base, "--cni-socket", "/var/run//redirector/cni.sock"), want: `is not an absolute, clean path`},
		{args: append(base, "--cni-socket", "/var/run/"+strings.Repeat("r", 90)+"/cni.sock"), want: `more than the 95 a unix socket's name leaves it`},
		{args: append(base, "--handover-socket", "handover.sock"), want: `--handover-socket (HANDOVER_SOCKET): "handover.sock" is not an absolute, clean path`},
		{args: append(base, "--cni-socket", "/var/run/redirector/x.sock", "--handover-socket", "/var/run/redirector/x.sock"),
			want: `--handover-socket (HANDOVER_SOCKET): "/var/run/redirector/x.sock" is also --cni-socket (CNI_SOCKET): the sockets need paths of their own`},
		{args: append(base, "--handover-socket", "/var/run/redirector/x.sock", "--readiness-socket", "/var/run/redirector/x.sock"),
			want: `--readiness-socket (READINESS_SOCKET): "/var/run/redirector/x.sock" is also --handover-socket (HANDOVER_SOCKET): the sockets need paths of their own`},
		{args: append(base, "--readiness-socket", "tmp/ready.sock"), want: `--readiness-socket (READINESS_SOCKET): "tmp/ready.sock" is not an absolute, clean path`},
		{args: append(base, "--reconcile-period", "1ms"), want: `--reconcile-period (RECONCILE_PERIOD): 1ms is shorter than the 1s minimum`},
		{args: append(base, "--ca-root-cert-reload", "1ns"), want: `--ca-root-cert-reload (CA_ROOT_CERT_RELOAD): 1ns is shorter than the 1s minimum`},
	} {
		_, err := parseRunFlags(tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseRunFlags(%q) = %v, want an error containing %q", tc.args[len(tc.args)-2:], err, tc.want)
		}
	}
	for _, args := range [][]string{
		append(base, "--node-name", "ip-10-0-0-1.eu-west-1.compute.internal", "--root-namespace", "mesh-root", "--pod-namespace", "istio-system", "--cluster-id", "Kubernetes"),
		append(base, "--cluster-id", "", "--cni-socket", "/var/run/redirector/cni.sock"),
		append(xds, "--pod-name", "ztunnel-abc12", "--cluster-id", "east_1.prod"),
	} {
		if _, err := parseRunFlags(args); err != nil {
			t.Errorf("parseRunFlags(%q) = %v, want no error", args, err)
		}
	}
}

// TestRunSettingsEndpointsNeedPortsApart: the endpoints bind with
// SO_REUSEPORT (an upgrading agent binds them beside its predecessor), so
// two of them on one port of overlapping hosts both started, and the
// kernel spread connections over the two: kubelet's probe reached /metrics
// at random. Such settings now fail at start, naming both.
func TestRunSettingsEndpointsNeedPortsApart(t *testing.T) {
	base := []string{"--node-name", "n1", "--source", "file:/tmp", "--ca-dir", "/tmp"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{args: append(base, "--metrics-addr", ":15020", "--readiness-addr", ":15020"),
			want: `--readiness-addr (READINESS_ADDR) ":15020" and --metrics-addr (METRICS_ADDR) ":15020" share port 15020 on overlapping hosts`},
		{args: append(base, "--admin-addr", ":15020"), want: `--admin-addr (ADMIN_ADDR) ":15020" and --metrics-addr (METRICS_ADDR) ":15020"`},
		// The default 127.0.0.1:15000 is inside every address.
		{args: append(base, "--metrics-addr", "0.0.0.0:15000"), want: `--admin-addr (ADMIN_ADDR) "127.0.0.1:15000" and --metrics-addr (METRICS_ADDR) "0.0.0.0:15000"`},
		{args: append(base, "--readiness-addr", "[::]:15000"), want: `--admin-addr (ADMIN_ADDR) "127.0.0.1:15000" and --readiness-addr (READINESS_ADDR) "[::]:15000"`},
		{args: append(base, "--metrics-addr", "10.0.0.1:9000", "--readiness-addr", "10.0.0.1:09000"), want: "share port 9000"},
		{args: append(base, "--metrics-addr", "[::ffff:10.0.0.1]:9000", "--readiness-addr", "10.0.0.1:9000"), want: "share port 9000"},
		{args: append(base, "--metrics-addr", "Node-A:9000", "--readiness-addr", "node-a:9000"), want: "share port 9000"},
		// Go listens on [::] for the mapped spelling of 0.0.0.0 (8 December).
		{args: append(base, "--metrics-addr", "[::ffff:0.0.0.0]:15000"), want: `--admin-addr (ADMIN_ADDR) "127.0.0.1:15000" and --metrics-addr (METRICS_ADDR) "[::ffff:0.0.0.0]:15000"`},
	} {
		_, err := parseRunFlags(tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseRunFlags(%q) = %v, want an error containing %q", tc.args[len(base):], err, tc.want)
		}
	}
	for _, args := range [][]string{
		append(base, "--metrics-addr", "10.0.0.1:15020", "--readiness-addr", "10.0.0.2:15020"), // two hosts of their own
		append(base, "--metrics-addr", "127.0.0.1:0", "--readiness-addr", "127.0.0.1:0", "--admin-addr", ":0"),
		append(base, "--metrics-addr", "", "--readiness-addr", ":15021", "--admin-addr", ""), // endpoints left out
	} {
		if _, err := parseRunFlags(args); err != nil {
			t.Errorf("parseRunFlags(%q) = %v, want no error", args[len(base):], err)
		}
	}
}

// TestRunSettingsDirectoriesAreAbsoluteAndClean: PROC_DIR, BPF_ROOT and
// CGROUP_ROOT are refused, named, unless absolute and clean, as the socket
// paths are. Before, a relative PROC_DIR or BPF_ROOT (an empty one too) was
// taken relative to the agent's working directory, and CGROUP_ROOT had only
// to be absolute: /sys/fs/cgroup/../../etc passed.
func TestRunSettingsDirectoriesAreAbsoluteAndClean(t *testing.T) {
	base := []string{"--node-name", "n1", "--source", "file:/tmp", "--ca-dir", "/tmp"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{args: append(base, "--proc-dir", "proc"), want: `--proc-dir (PROC_DIR): "proc" is not an absolute, clean path`},
		{args: append(base, "--proc-dir", ""), want: `--proc-dir (PROC_DIR): "" is not an absolute, clean path`},
		{args: append(base, "--proc-dir", "/host/proc/"), want: `--proc-dir (PROC_DIR): "/host/proc/" is not an absolute, clean path`},
		{args: append(base, "--bpf-root", "bpf"), want: `--bpf-root (BPF_ROOT): "bpf" is not an absolute, clean path`},
		{args: append(base, "--bpf-root", "/sys/fs/bpf//redirector"), want: `--bpf-root (BPF_ROOT): "/sys/fs/bpf//redirector" is not an absolute, clean path`},
		{args: append(base, "--cgroup-root", "/sys/fs/cgroup/../../etc"), want: `--cgroup-root (CGROUP_ROOT): "/sys/fs/cgroup/../../etc" is not an absolute, clean path`},
		{args: append(base, "--cgroup-root", "sys/fs/cgroup"), want: `--cgroup-root (CGROUP_ROOT): "sys/fs/cgroup" is not an absolute, clean path`},
	} {
		_, err := parseRunFlags(tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseRunFlags(%q) = %v, want an error containing %q", tc.args[len(base):], err, tc.want)
		}
	}
	cfg, err := parseRunFlags(append(base, "--proc-dir", "/host/proc", "--bpf-root", "/sys/fs/bpf/r", "--cgroup-root", ""))
	if err != nil || cfg.procDir != "/host/proc" || cfg.bpfRoot != "/sys/fs/bpf/r" || cfg.cgroupRoot != "" {
		t.Errorf("clean paths and an empty CGROUP_ROOT: %v (proc %q bpf %q cgroup %q), want them taken", err, cfg.procDir, cfg.bpfRoot, cfg.cgroupRoot)
	}
	// uninstall takes the same two directories.
	if _, _, err := parseUninstallFlags([]string{"--bpf-root", "bpf"}); err == nil || !strings.Contains(err.Error(), `--bpf-root (BPF_ROOT): "bpf" is not an absolute, clean path`) {
		t.Errorf("uninstall --bpf-root bpf: %v, want an error naming the setting", err)
	}
	if _, _, err := parseUninstallFlags([]string{"--proc-dir", "/proc/./"}); err == nil || !strings.Contains(err.Error(), `--proc-dir (PROC_DIR): "/proc/./" is not an absolute, clean path`) {
		t.Errorf("uninstall --proc-dir /proc/./: %v, want an error naming the setting", err)
	}
}

// TestRunSettingsLogLevelOnlyNames: LOG_LEVEL takes the names listed in
// its help, in any case, and nothing else. Before, slog's parser took
// offsets too ("debug-100", "INFO+2"), levels no log line is written at
// and which POST /logging refuses.
func TestRunSettingsLogLevelOnlyNames(t *testing.T) {
	base := []string{"--node-name", "n1", "--source", "file:/tmp", "--ca-dir", "/tmp"}
	for _, level := range []string{"debug-100", "INFO+2", "warning", ""} {
		_, err := parseRunFlags(append(base, "--log-level", level))
		if want := fmt.Sprintf("--log-level (LOG_LEVEL): %q is not debug, info, warn or error", level); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("--log-level %q: %v, want an error containing %q", level, err, want)
		}
	}
	for level, want := range map[string]slog.Level{"debug": slog.LevelDebug, "Info": slog.LevelInfo, "WARN": slog.LevelWarn, "error": slog.LevelError} {
		if cfg, err := parseRunFlags(append(base, "--log-level", level)); err != nil || cfg.logLevel != want {
			t.Errorf("--log-level %q: %v, level %s, want %s", level, err, cfg.logLevel, want)
		}
	}
}

// TestRunSocketPathsCheckedAtStart: a socket setting whose path the agent
// can never serve (something other than a socket there, a parent that is
// not a directory, a directory others may write) fails at start, naming
// the setting. Before, READINESS_SOCKET was first tried by admin.Start,
// after the agent had loaded its programs and claimed the node: the agent
// exited with an error naming no setting, and crash-looped holding the
// claim, so that during an upgrade the old agent, which had yielded, no
// longer enrolled the node's new pods either.
func TestRunSocketPathsCheckedAtStart(t *testing.T) {
	base := []string{"--node-name", "n1", "--source", "file:/tmp", "--ca-dir", "/tmp"}
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	sub := filepath.Join(dir, "sub")
	if err := os.Mkdir(sub, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.sock")
	if err := os.Symlink(filepath.Join(dir, "elsewhere.sock"), link); err != nil {
		t.Fatal(err)
	}
	open := filepath.Join(dir, "open")
	if err := os.Mkdir(open, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		flag, path, want string
	}{
		{"--readiness-socket", sub, `--readiness-socket (READINESS_SOCKET): readiness socket path ` + sub + ` exists and is not a socket (a directory)`},
		{"--readiness-socket", file, `--readiness-socket (READINESS_SOCKET): readiness socket path ` + file + ` exists and is not a socket (a regular file)`},
		{"--readiness-socket", link, `--readiness-socket (READINESS_SOCKET): readiness socket path ` + link + ` exists and is not a socket (a symbolic link)`},
		{"--readiness-socket", filepath.Join(file, "x", "ready.sock"), `--readiness-socket (READINESS_SOCKET): readiness socket directory ` + filepath.Join(file, "x") + `: ` + file + ` is not a directory`},
		{"--readiness-socket", filepath.Join(open, "ready.sock"), `--readiness-socket (READINESS_SOCKET): readiness socket directory ` + open + ` is writable by group or others`},
		{"--cni-socket", sub, `--cni-socket (CNI_SOCKET): CNI socket path ` + sub + ` exists and is not a socket (a directory)`},
		{"--handover-socket", file, `--handover-socket (HANDOVER_SOCKET): hand-over socket path ` + file + ` exists and is not a socket (a regular file)`},
	} {
		_, err := parseRunFlags(append(base, tc.flag, tc.path))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %s: %v, want an error containing %q", tc.flag, tc.path, err, tc.want)
		}
	}
	// A directory still to be made (the agent makes it, mode 0700) is fine.
	if _, err := parseRunFlags(append(base, "--readiness-socket", filepath.Join(dir, "new", "ready", "agent.sock"))); err != nil {
		t.Errorf("socket in a directory still to be made: %v, want no error", err)
	}
}
