// Command meshbench measures what the mesh costs. It builds its own simulated
// cluster with the test harness (two nodes in network namespaces, the real
// `redirector run` agents), runs the same load against six variants of the
// path between a client pod and a server pod (one of them a pair of stunnel
// relays, the mature peer the mesh is compared with), interleaved round-robin so
// that the machine's noise hits every variant alike, and writes a table, a
// JSON file and a PNG plot under -out.
//
//	meshbench [--quick] [--runs N] [--bin DIR] [--fortio PATH] [--out DIR] ...
//
// The same binary also serves as the small helper programs the suite runs
// inside pod namespaces (echo server, clients, relay); see helpers.go.
//
// It needs root. Everything it creates (namespaces, agents, pins, helper
// processes) is removed at the end, on failure, and on Ctrl-C.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

func main() {
	if len(os.Args) > 1 {
		if h, ok := helpers[os.Args[1]]; ok {
			if err := h(os.Args[2:]); err != nil {
				fmt.Fprintf(os.Stderr, "meshbench %s: %v\n", os.Args[1], err)
				os.Exit(1)
			}
			return
		}
	}
	cfg, err := parseConfig(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "meshbench:", err)
		os.Exit(2)
	}
	os.Exit(suiteMain(cfg))
}

// suiteMain runs the suite with cleanup on every way out: success, failure,
// and signals (the first cancels and lets the suite unwind; a second, or an
// unwind that takes too long, cleans up from the signal handler and exits).
func suiteMain(cfg config) int {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "meshbench: creates network namespaces, loads BPF programs and runs agents: run it as root")
		return 1
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r := netnstest.NewRunner("meshbench-")
	defer r.Close() // also when a bug panics
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sigs
		fmt.Fprintln(os.Stderr, "\ninterrupted: stopping and cleaning up (again to force)")
		cancel()
		select {
		case <-sigs:
		case <-time.After(30 * time.Second):
		}
		r.Close()
		os.Exit(130)
	}()

	err := r.Protect(func() error { return runSuite(ctx, r, cfg) })
	r.Close()
	fmt.Fprintln(os.Stderr, "cleaned up: namespaces, agents, pins and helper processes are gone")
	switch {
	case ctx.Err() != nil:
		return 130
	case err != nil:
		fmt.Fprintln(os.Stderr, "meshbench failed:", err)
		return 1
	}
	return 0
}

// config holds the flags. Durations of zero take the mode's default (quick
// or full), so `--quick --runs 5` works as expected.
type config struct {
	Quick     bool          `json:"quick"`
	Runs      int           `json:"runs"`
	IperfTime time.Duration `json:"iperf_time"`
	// IperfSlices cuts each bulk test into slices that alternate between
	// the variants (slices.go).
	IperfSlices int           `json:"iperf_slices"`
	HTTPTime    time.Duration `json:"http_time"`
	// HTTPSlices cuts the fixed HTTP load into slices that alternate
	// between the variants (slices.go).
	HTTPSlices  int           `json:"http_slices"`
	HTTPMaxTime time.Duration `json:"http_max_time"`
	HTTPQPS     int           `json:"http_qps"`
	HTTPConns   int           `json:"http_conns"`
	HTTPPayload int           `json:"http_payload"`
	RRCount     int           `json:"rr_count"`
	// RRSlices cuts the round trips into slices that alternate between the
	// variants (slices.go).
	RRSlices    int           `json:"rr_slices"`
	CPSTime     time.Duration `json:"cps_time"`
	CPSConc     int           `json:"cps_concurrency"`
	IdleConns   int           `json:"idle_conns"`
	ProfileTime time.Duration `json:"profile_time"`
	BenchTime   string        `json:"benchtime"`
	Micro       bool          `json:"micro"`
	// Sockops starts the agents with SOCKOPS_ACCELERATION on.
	Sockops bool `json:"sockops"`
	// Awake keeps every CPU out of its idle state with SCHED_IDLE spinners.
	Awake bool `json:"awake,omitempty"`
	// Congestion is the TCP congestion control of every namespace the suite
	// creates (nodes and pods: apps, proxies and agents alike), set with the
	// per-namespace sysctl; empty keeps what a new namespace inherits from
	// the machine. The machine's own namespace is never touched.
	Congestion string `json:"congestion,omitempty"`
	// AgentEnv is extra environment for the agents (e.g. GOMAXPROCS=1).
	AgentEnv []string `json:"agent_env,omitempty"`
	// AltAgentEnv and AltBin start a second pair of agents (nodes 3 and 4)
	// with extra environment or another binary, for the variant
	// meshed-alt: an on/off comparison in one run.
	AltAgentEnv []string `json:"alt_agent_env,omitempty"`
	AltBin      string   `json:"alt_bin,omitempty"`
	// Tests, when not empty, are the only tests run (keys of tests), for a
	// quick look at one number; a full run leaves it empty.
	Tests []string `json:"tests,omitempty"`
	// Strict fails the run unless every variant produced every number.
	Strict bool `json:"-"`

	Bin    string `json:"-"`
	Fortio string `json:"-"`
	Out    string `json:"-"`
	Repo   string `json:"-"`
}

// MarshalJSON writes durations as text ("4s"), not nanoseconds.
func (c config) MarshalJSON() ([]byte, error) {
	type plain config
	return json.Marshal(struct {
		plain
		IperfTime   string `json:"iperf_time"`
		HTTPTime    string `json:"http_time"`
		HTTPMaxTime string `json:"http_max_time"`
		CPSTime     string `json:"cps_time"`
		ProfileTime string `json:"profile_time"`
	}{plain(c), c.IperfTime.String(), c.HTTPTime.String(), c.HTTPMaxTime.String(), c.CPSTime.String(), c.ProfileTime.String()})
}

func parseConfig(args []string) (config, error) {
	var c config
	fs := flag.NewFlagSet("meshbench", flag.ContinueOnError)
	fs.BoolVar(&c.Quick, "quick", false, "short runs (about 2 minutes in all) for a smoke test of the suite")
	fs.IntVar(&c.Runs, "runs", 0, "interleaved rounds per variant (default 5, quick 3)")
	fs.DurationVar(&c.IperfTime, "iperf-time", 0, "iperf3 duration, whole seconds (default 4s, quick 1s)")
	fs.DurationVar(&c.HTTPTime, "http-time", 0, "fortio fixed-load duration (default 10s, quick 2s)")
	fs.IntVar(&c.IperfSlices, "iperf-slices", 0, "slices of each bulk test, alternating between the variants, of whole seconds each (default 2 slices if --iperf-time is an even number of seconds, else 1)")
	fs.IntVar(&c.HTTPSlices, "http-slices", 0, "slices of the fixed HTTP load, alternating between the variants, of at least 1s each (default 5, or one per second of --http-time if fewer)")
	fs.DurationVar(&c.HTTPMaxTime, "http-max-time", 0, "fortio max-qps duration (default 4s, quick 1s)")
	fs.IntVar(&c.HTTPQPS, "http-qps", 1000, "fortio fixed load, requests per second")
	fs.IntVar(&c.HTTPConns, "http-conns", 16, "fortio connections")
	fs.IntVar(&c.HTTPPayload, "http-payload", 1024, "fortio request payload bytes (echoed back)")
	fs.IntVar(&c.RRCount, "rr-count", 0, "1-byte round trips per sample (default 20000, quick 3000)")
	fs.IntVar(&c.RRSlices, "rr-slices", 0, "slices of the round trips, alternating between the variants, each on a new connection of at least 1000 round trips (default 4, or one per 1000 of --rr-count if fewer)")
	fs.DurationVar(&c.CPSTime, "cps-time", 0, "new-connection test duration (default 2s, quick 1s)")
	fs.IntVar(&c.CPSConc, "cps-concurrency", 1, "new-connection clients in parallel")
	fs.IntVar(&c.IdleConns, "idle-conns", 1000, "idle meshed connections for the RSS measurement")
	fs.DurationVar(&c.ProfileTime, "profile-time", 0, "agent CPU profile length per load (default 8s, quick 2s; negative: none)")
	fs.StringVar(&c.BenchTime, "benchtime", "", "go test -benchtime for the microbenchmarks (default 500ms, quick 50ms)")
	fs.BoolVar(&c.Micro, "micro", true, "also run the Go microbenchmarks of ./pkg/...")
	fs.BoolVar(&c.Strict, "strict", false, "fail unless every variant produced every number (the CI smoke run)")
	fs.BoolVar(&c.Sockops, "sockops", false, "run the agents with --sockops-acceleration=true (compare with a run without)")
	fs.BoolVar(&c.Awake, "awake", false, "keep every CPU awake with a SCHED_IDLE busy loop (shows what idle-CPU wake-ups cost the latencies)")
	fs.StringVar(&c.Congestion, "congestion", "", "TCP congestion control for every namespace of the suite (e.g. cubic, bbr; default: the machine's, inherited)")
	fs.Func("agent-env", "NAME=value added to the agents' environment (repeatable), e.g. GOMAXPROCS=1", func(v string) error {
		if name, _, ok := strings.Cut(v, "="); !ok || name == "" {
			return fmt.Errorf("want NAME=value, got %q", v)
		}
		c.AgentEnv = append(c.AgentEnv, v)
		return nil
	})
	fs.Func("alt-agent-env", "NAME=value for a second pair of agents (nodes 3 and 4, variant meshed-alt), repeatable: an on/off comparison in one run", func(v string) error {
		if name, _, ok := strings.Cut(v, "="); !ok || name == "" {
			return fmt.Errorf("want NAME=value, got %q", v)
		}
		c.AltAgentEnv = append(c.AltAgentEnv, v)
		return nil
	})
	fs.Func("tests", "run only these tests, comma-separated ("+strings.Join(testKeys(), ",")+"; default all)", func(v string) error {
		for _, k := range strings.Split(v, ",") {
			if !slices.Contains(testKeys(), k) {
				return fmt.Errorf("unknown test %q (have %s)", k, strings.Join(testKeys(), ","))
			}
			c.Tests = append(c.Tests, k)
		}
		return nil
	})
	fs.StringVar(&c.AltBin, "alt-bin", "", "directory holding another redirector binary for the second pair of agents (variant meshed-alt)")
	fs.StringVar(&c.Bin, "bin", "bin", "directory holding the redirector binary")
	fs.StringVar(&c.Fortio, "fortio", "", "fortio binary (built by make bench)")
	fs.StringVar(&c.Out, "out", "bench/results", "where results, plot and profiles go")
	fs.StringVar(&c.Repo, "repo", ".", "root of the redirector module (for the microbenchmarks)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	def := func(d *time.Duration, full, quick time.Duration) {
		if *d == 0 {
			*d = full
			if c.Quick {
				*d = quick
			}
		}
	}
	def(&c.IperfTime, 4*time.Second, time.Second)
	def(&c.HTTPTime, 10*time.Second, 2*time.Second)
	def(&c.HTTPMaxTime, 4*time.Second, time.Second)
	def(&c.CPSTime, 2*time.Second, time.Second)
	def(&c.ProfileTime, 8*time.Second, 2*time.Second)
	if c.Runs == 0 {
		c.Runs = map[bool]int{false: 5, true: 3}[c.Quick]
	}
	if c.RRCount == 0 {
		c.RRCount = map[bool]int{false: 20000, true: 3000}[c.Quick]
	}
	if c.RRSlices == 0 {
		c.RRSlices = max(1, min(4, c.RRCount/1000))
	}
	// One slice may be any --rr-count; more than one must each make 1000
	// round trips at least, so that a slice's p99 is not its worst one or two.
	if c.RRSlices < 1 || (c.RRSlices > 1 && c.RRCount/c.RRSlices < 1000) {
		return c, fmt.Errorf("--rr-slices %d: must be 1, or leave each slice of --rr-count %d 1000 round trips or more", c.RRSlices, c.RRCount)
	}
	if c.BenchTime == "" {
		c.BenchTime = map[bool]string{false: "500ms", true: "50ms"}[c.Quick]
	}
	if c.HTTPSlices == 0 {
		c.HTTPSlices = max(1, min(5, int(c.HTTPTime/time.Second)))
	}
	// One slice may be as short as --http-time; more than one must each be
	// a second at least, or fortio's warm-up weighs on every slice.
	if c.HTTPSlices < 1 || (c.HTTPSlices > 1 && c.HTTPTime/time.Duration(c.HTTPSlices) < time.Second) {
		return c, fmt.Errorf("--http-slices %d: must be 1, or leave each slice of --http-time %s 1s or more", c.HTTPSlices, c.HTTPTime)
	}
	if c.IperfTime < time.Second || c.IperfTime%time.Second != 0 {
		return c, fmt.Errorf("--iperf-time %s: iperf3 takes whole seconds", c.IperfTime)
	}
	if c.IperfSlices == 0 {
		c.IperfSlices = map[bool]int{false: 1, true: 2}[c.IperfTime%(2*time.Second) == 0]
	}
	if c.IperfSlices < 1 || int(c.IperfTime/time.Second)%c.IperfSlices != 0 {
		return c, fmt.Errorf("--iperf-slices %d: must cut --iperf-time %s into slices of whole seconds", c.IperfSlices, c.IperfTime)
	}
	if c.Runs < 1 || c.RRCount < 10 || c.HTTPConns < 1 || c.CPSConc < 1 || c.IdleConns < 1 {
		return c, fmt.Errorf("--runs, --rr-count, --http-conns, --cps-concurrency and --idle-conns must be positive")
	}
	if c.Fortio == "" {
		return c, fmt.Errorf("--fortio is required (make bench builds it)")
	}
	if c.Congestion != "" {
		if err := netns.CheckCongestion(c.Congestion); err != nil {
			return c, fmt.Errorf("--congestion: %w", err)
		}
		if err := checkNamespaceDefault(c.Congestion); err != nil {
			return c, fmt.Errorf("--congestion: %w", err)
		}
	}
	if c.AltBin != "" {
		abs, err := filepath.Abs(c.AltBin)
		if err != nil {
			return c, err
		}
		c.AltBin = abs
		if _, err := os.Stat(c.altBinary()); err != nil {
			return c, fmt.Errorf("--alt-bin: %w", err)
		}
	}
	for _, p := range []*string{&c.Bin, &c.Fortio, &c.Out, &c.Repo} {
		abs, err := filepath.Abs(*p)
		if err != nil {
			return c, err
		}
		*p = abs
	}
	for _, f := range []string{filepath.Join(c.Bin, "redirector"), c.Fortio} {
		if _, err := os.Stat(f); err != nil {
			return c, fmt.Errorf("need %s: %w (run make bench)", f, err)
		}
	}
	return c, nil
}

// runs tells whether test t is selected: named by --tests, or every test
// but the opt-in ones when --tests is not given.
func (c config) runs(t test) bool {
	return slices.Contains(c.Tests, t.key) || (len(c.Tests) == 0 && !t.optIn)
}

// altVariant is the variant of the second pair of agents.
const altVariant = "meshed-alt"

// alt tells whether a second pair of agents runs.
func (c config) alt() bool { return len(c.AltAgentEnv) > 0 || c.AltBin != "" }

// altBinary is the second pair's agent binary.
func (c config) altBinary() string {
	if c.AltBin != "" {
		return filepath.Join(c.AltBin, "redirector")
	}
	return filepath.Join(c.Bin, "redirector")
}

// altDesc says how the second pair differs.
func (c config) altDesc() string {
	var parts []string
	if c.AltBin != "" {
		parts = append(parts, "binary "+c.altBinary())
	}
	if len(c.AltAgentEnv) > 0 {
		parts = append(parts, strings.Join(c.AltAgentEnv, " "))
	}
	return strings.Join(parts, ", ")
}
