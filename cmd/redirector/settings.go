package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redirector-mesh/redirector/pkg/tunnel"
)

// setting is one command-line flag with its environment twin. The flag wins
// over the environment, which wins over the default. A setting without an
// env twin (env "") is read from the command line only: a generic name such
// as -o must not pick up an unrelated OUTPUT variable.
type setting struct {
	flag, env, def, usage string
	typ                   string // shown in help: host:port, duration, int, bool or string
	value                 *string
}

// settings is a flag set whose every flag has an env twin, so the same
// binary is configured by flags on a laptop and by env in a DaemonSet.
type settings struct {
	fs   *flag.FlagSet
	list []*setting
	// synopsis is the first line of -h, e.g. "redirector uninstall [flags]".
	synopsis string
	// out receives -h's help (stdout: help asked for is output, not an error).
	out io.Writer
}

func newSettings(name string) *settings {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	// The flag package's own messages are replaced: help goes to out, and a
	// parse error is returned, which main prints once.
	fs.SetOutput(io.Discard)
	return &settings{fs: fs, synopsis: "redirector " + name + " [flags]", out: os.Stdout}
}

// add registers --flag with env twin ENV (none if env is "") and returns
// where its value lands.
func (s *settings) add(flagName, env, def, usage string) *string {
	st := &setting{flag: flagName, env: env, def: def, usage: usage, typ: settingType(flagName, def), value: new(string)}
	s.list = append(s.list, st)
	s.fs.StringVar(st.value, flagName, def, usage)
	return st.value
}

// settingType is the kind of value a setting takes, for help and for the
// checks parse makes. Addresses are named *-addr or *-address by
// convention; the other kinds follow from the default value.
func settingType(flagName, def string) string {
	switch {
	case strings.HasSuffix(flagName, "-addr"), strings.HasSuffix(flagName, "-address"):
		return "host:port"
	case def == "true" || def == "false":
		return "bool"
	}
	if _, err := strconv.Atoi(def); err == nil {
		return "int"
	}
	if _, err := time.ParseDuration(def); err == nil && def != "0" {
		return "duration"
	}
	return "string"
}

// parse reads env twins first, then the command line over them. -h prints
// help to out and returns flag.ErrHelp; arguments left over after the flags
// are an error, as is an address setting that is not host:port.
func (s *settings) parse(args []string) error {
	for _, st := range s.list {
		if st.env == "" {
			continue
		}
		if v, ok := os.LookupEnv(st.env); ok {
			*st.value = v
		}
	}
	if err := s.fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			s.help()
			return err
		}
		return fmt.Errorf("%s: %w (see %s -h)", s.fs.Name(), err, "redirector "+s.fs.Name())
	}
	if s.fs.NArg() > 0 {
		return fmt.Errorf("%s: unexpected argument %q (settings are given as --name value; see redirector %s -h)", s.fs.Name(), s.fs.Arg(0), s.fs.Name())
	}
	for _, st := range s.list {
		if st.typ != "host:port" || *st.value == "" {
			continue
		}
		if err := checkAddr(*st.value); err != nil {
			return fmt.Errorf("%s: %q is not host:port: %w", s.name(st.value), *st.value, err)
		}
	}
	return nil
}

// checkAddr accepts host:port with a numeric port; the host may be empty
// (every address), an IP (IPv6 in brackets) or a DNS name.
func checkAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || (n == 0 && port != "0") {
		return fmt.Errorf("port %q is not a number from 0 to 65535", port)
	}
	if strings.ContainsAny(host, " /\\") {
		return fmt.Errorf("host %q is neither an IP address nor a DNS name", host)
	}
	return nil
}

// checkCleanPath accepts an absolute path with nothing to clean: no empty,
// "." or ".." element and no trailing slash. The agent joins names to such
// paths and compares them (its pins under BPF_ROOT, a pod's network
// namespace under PROC_DIR, the cgroup its programs attach to), and hands
// them to processes with another working directory (the CNI plugin, a
// successor agent, `redirector uninstall`): a relative path would name
// another place there, an unclean one the same place under another name.
func checkCleanPath(path string) error {
	if !filepath.IsAbs(path) || filepath.Clean(path) != path {
		return fmt.Errorf("%q is not an absolute, clean path", path)
	}
	return nil
}

// checkPaths fails naming the first of values that is not an absolute,
// clean path (an empty one included).
func (s *settings) checkPaths(values ...*string) error {
	for _, v := range values {
		if err := checkCleanPath(*v); err != nil {
			return fmt.Errorf("%s: %w", s.name(v), err)
		}
	}
	return nil
}

// checkPortsApart refuses two of the agent's listen addresses that share a
// port on overlapping hosts: the same host, or either one every address
// (an empty host, 0.0.0.0 or ::). The endpoints bind with SO_REUSEPORT, so
// that an upgrading agent binds them beside its predecessor: two endpoints
// on one port would both bind without error, and the kernel would spread
// connections over them, so kubelet's probe would reach /metrics at
// random and the agent would flap NotReady. Port 0 (the kernel's choice)
// never clashes; hosts given by name are compared as written.
func (s *settings) checkPortsApart(values ...*string) error {
	for i, a := range values {
		for _, b := range values[:i] {
			if port, ok := sharePort(*a, *b); ok {
				return fmt.Errorf("%s %q and %s %q share port %d on overlapping hosts: both would bind, each getting some of the other's connections; give each a port of its own",
					s.name(a), *a, s.name(b), *b, port)
			}
		}
	}
	return nil
}

// sharePort reports whether the host:port addresses a and b (checked by
// checkAddr, or empty for an endpoint left out) would take each other's
// connections, and on which port.
func sharePort(a, b string) (uint64, bool) {
	if a == "" || b == "" {
		return 0, false
	}
	hostA, portA, _ := net.SplitHostPort(a)
	hostB, portB, _ := net.SplitHostPort(b)
	pa, _ := strconv.ParseUint(portA, 10, 16)
	pb, _ := strconv.ParseUint(portB, 10, 16)
	if pa != pb || pa == 0 {
		return 0, false
	}
	return pa, isWildcardHost(hostA) || isWildcardHost(hostB) || sameHost(hostA, hostB)
}

// isWildcardHost: the IPv4-mapped ::ffff:0.0.0.0 is every address too (Go
// listens on [::] for it), which ip.IsUnspecified alone does not say.
func isWildcardHost(host string) bool {
	ip, err := netip.ParseAddr(host)
	return host == "" || err == nil && ip.Unmap().IsUnspecified()
}

func sameHost(a, b string) bool {
	ipA, errA := netip.ParseAddr(a)
	ipB, errB := netip.ParseAddr(b)
	if errA == nil && errB == nil {
		return ipA.Unmap() == ipB.Unmap()
	}
	return strings.EqualFold(a, b)
}

// help prints the synopsis and every setting with its type, env twin and
// default.
func (s *settings) help() {
	fmt.Fprintf(s.out, "usage: %s\n", s.synopsis)
	if len(s.list) == 0 {
		return
	}
	fmt.Fprintln(s.out, "\nflags (a flag wins over its environment variable, which wins over the default):")
	for _, st := range s.list {
		fmt.Fprintf(s.out, "  -%s %s\n", st.flag, st.typ)
		var notes []string
		if st.env != "" {
			notes = append(notes, "env "+st.env)
		}
		if st.def != "" {
			notes = append(notes, fmt.Sprintf("default %q", st.def))
		}
		line := st.usage
		if len(notes) > 0 {
			line += " (" + strings.Join(notes, ", ") + ")"
		}
		fmt.Fprintf(s.out, "\t%s\n", line)
	}
}

// isHelp reports whether a command's first argument asks for help.
func isHelp(arg string) bool {
	return arg == "-h" || arg == "-help" || arg == "--help" || arg == "help"
}

// name is how errors refer to a setting: both spellings, so a user finds it
// whichever way they set it.
func (s *settings) name(value *string) string {
	for _, st := range s.list {
		if st.value == value {
			if st.env == "" {
				return "-" + st.flag
			}
			return fmt.Sprintf("--%s (%s)", st.flag, st.env)
		}
	}
	return "setting"
}

// require fails naming the first empty required setting.
func (s *settings) require(values ...*string) error {
	for _, v := range values {
		if strings.TrimSpace(*v) == "" {
			return fmt.Errorf("%s is required", s.name(v))
		}
	}
	return nil
}

// addLimitSettings registers the tunnel's connection limits (see
// tunnel.Limits for what each bounds and why the defaults); the returned
// function reads them once the settings are parsed.
func addLimitSettings(s *settings) func() (tunnel.Limits, error) {
	def := tunnel.DefaultLimits()
	node := s.add("max-connections", "MAX_CONNECTIONS", strconv.Itoa(def.PerNode),
		"open connections per kind (outbound, inbound plaintext, inbound HBONE tunnels) on this node; more are refused and counted")
	pod := s.add("max-connections-per-pod", "MAX_CONNECTIONS_PER_POD", strconv.Itoa(def.PerPod),
		"open connections per kind of one pod")
	src := s.add("max-connections-per-source", "MAX_CONNECTIONS_PER_SOURCE", strconv.Itoa(def.PerSource),
		"open inbound connections from one client address on this node, plaintext and HBONE tunnels each")
	return func() (tunnel.Limits, error) {
		var l tunnel.Limits
		for _, v := range []struct {
			dst *int
			val *string
		}{{&l.PerNode, node}, {&l.PerPod, pod}, {&l.PerSource, src}} {
			n, err := strconv.Atoi(*v.val)
			if err != nil || n < 1 {
				return l, fmt.Errorf("%s: %q is not a positive integer", s.name(v.val), *v.val)
			}
			*v.dst = n
		}
		return l, nil
	}
}
