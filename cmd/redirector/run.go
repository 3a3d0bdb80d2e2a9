package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/redirector-mesh/redirector/pkg/accel"
	"github.com/redirector-mesh/redirector/pkg/admin"
	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/nodeagent"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/probe"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/file"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
	"github.com/redirector-mesh/redirector/pkg/source/kubernetes"
	"github.com/redirector-mesh/redirector/pkg/tunnel"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/unixsock"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// maxPoolConnsPerKey bounds POOL_CONNS_PER_KEY: the connections one pod may
// hold to another are a resource a setting makes the agent hold.
const maxPoolConnsPerKey = 16

// maxCertTTL bounds CERT_TTL at a year: a leaked key should not stay good
// for longer, and istiod caps what it signs anyway (MAX_WORKLOAD_CERT_TTL,
// 90 days unless its operator raised it; a year leaves room for that).
const maxCertTTL = 365 * 24 * time.Hour

// agentConfig is every setting of `redirector run`, validated.
type agentConfig struct {
	node            string
	source          string // "kubernetes" or a file path
	kubeconfig      string
	caDir           string
	ca              caSettings
	xds             xdsSettings
	trustDomain     string
	bpfRoot         string
	metricsAddr     string
	readinessAddr   string
	readinessSocket string
	adminAddr       string
	selection       selection.Config
	rootNamespace   string
	certTTL         time.Duration
	reconcilePeriod time.Duration
	drainTimeout    time.Duration
	poolMaxStreams  int
	poolConns       int
	poolIdle        time.Duration
	seriesGrace     time.Duration
	telemetry       telemetrySettings
	dns             dnsSettings
	legacyTC        bool
	logLevel        slog.Level
	data            loader.Settings
	cniSocket       string
	handoverSocket  string
	accel           bool
	cgroupRoot      string
	podsCgroup      probe.PodsCgroup
	podsCgroupFound bool // false: looked for where kubelet puts pods, found none
	localRoute      bool
	replyPoll       hbone.ReplyPollConfig
	procDir         string
	hboneCongestion string
	limits          tunnel.Limits
}

// runFlags are the settings of `redirector run`, each with an env twin.
type runFlags struct {
	node, src, kubeconfig, caDir, td, bpfRoot, metrics, ready, readySocket, admin, exclude, ownNS, skipRC, rootNS, ttl, period, drain, maxStreams, poolConns, poolIdle, tcMode, probe4, probe6, logLevel, cniSocket, handoverSocket, accel, cgroupRoot, podsCgroup, localRoute, replyPoll, replyPollCPU, procDir, hboneCC *string
	limits                                                                                                                                                                                                                                                                                                                func() (tunnel.Limits, error)

	// ca: where certificates come from (ca.go).
	ca caFlags
	// xds: --source xds (xds.go).
	xds xdsFlags

	seriesGrace *string
	telemetry   telemetryFlags
	dns         dnsFlags
}

// runSettings registers the run settings; tests list them to check the README.
func runSettings() (*settings, runFlags) {
	s := newSettings("run")
	return s, runFlags{
		node:           s.add("node-name", "NODE_NAME", "", "name of this node; pods with this spec.nodeName are enrolled here"),
		src:            s.add("source", "SOURCE", "", "where pods and policies come from: file:PATH (a YAML file or directory), kubernetes, or xds (istiod, as ztunnel; enrollment from this node's pods)"),
		kubeconfig:     s.add("kubeconfig", "KUBECONFIG", "", "kubeconfig for --source kubernetes (empty: in-cluster)"),
		caDir:          s.add("ca-dir", "CA_DIR", "", "standalone only: directory with a file CA that signs on this node (redirector ca init's root-key.pem + root-cert.pem, or Istio's cacerts); exclusive with --ca-address"),
		td:             s.add("trust-domain", "TRUST_DOMAIN", "cluster.local", "SPIFFE trust domain; must match the CA's"),
		bpfRoot:        s.add("bpf-root", "BPF_ROOT", loader.DefaultPinRoot, "bpffs directory for pinned maps and links"),
		metrics:        s.add("metrics-addr", "METRICS_ADDR", ":15020", "address of the Prometheus /metrics endpoint"),
		ready:          s.add("readiness-addr", "READINESS_ADDR", ":15021", "address of /healthz/ready"),
		readySocket:    s.add("readiness-socket", "READINESS_SOCKET", "", "unix socket serving /healthz/ready too, for `redirector ready` (the chart's startup probe): a path private to the agent's container, which no predecessor agent beside it answers (empty: none)"),
		admin:          s.add("admin-addr", "ADMIN_ADDR", "127.0.0.1:15000", "address of the admin endpoint (config dump, pprof, logging)"),
		exclude:        s.add("exclude-namespaces", selection.EnvExcludeNamespaces, "kube-system", "comma-separated namespaces whose pods are never enrolled"),
		ownNS:          s.add("pod-namespace", "POD_NAMESPACE", "", "the agent's own namespace (in istiod's node id)"),
		skipRC:         s.add("skip-runtime-classes", selection.EnvSkipRuntimeClasses, "", "comma-separated RuntimeClass handlers whose pods are never enrolled"),
		rootNS:         s.add("root-namespace", "ROOT_NAMESPACE", policy.DefaultRootNamespace, "namespace of mesh-wide policies"),
		ttl:            s.add("cert-ttl", "CERT_TTL", "24h", "lifetime of workload certificates; rotated at half-life"),
		period:         s.add("reconcile-period", "RECONCILE_PERIOD", "30s", "interval of the full drift-repairing reconcile"),
		drain:          s.add("drain-timeout", "DRAIN_TIMEOUT", "10s", "how long SIGTERM waits for open connections"),
		maxStreams:     s.add("pool-max-streams", "POOL_MAX_STREAMS", "100", "HBONE streams per pooled connection"),
		poolConns:      s.add("pool-conns-per-key", "POOL_CONNS_PER_KEY", "2", "pooled HBONE connections a pod's streams to one destination pod are spread over (at most 16)"),
		hboneCC:        s.add("hbone-congestion-control", "HBONE_CONGESTION_CONTROL", "", "TCP congestion control of HBONE connections, node to node (empty: the pod's, which it inherits from the node); e.g. cubic on nodes whose default BBR paces the tunnel (see BENCHMARKS.md)"),
		poolIdle:       s.add("pool-idle-timeout", "POOL_IDLE_TIMEOUT", "30s", "idle pooled HBONE connections are closed after this"),
		tcMode:         s.add("tc-attach", "TC_ATTACH", "auto", "program attachment: auto (tcx), or legacy (clsact + cls_bpf)"),
		probe4:         s.add("host-probe-snat-ip", probe.EnvSNATv4, probe.DefaultSNATv4.String(), "source address kubelet probes are SNATed to (inside 169.254.0.0/16)"),
		probe6:         s.add("host-probe-snat-ipv6", probe.EnvSNATv6, probe.DefaultSNATv6.String(), "IPv6 source address kubelet probes are SNATed to"),
		logLevel:       s.add("log-level", "LOG_LEVEL", "info", "debug, info, warn or error"),
		accel:          s.add("sockops-acceleration", "SOCKOPS_ACCELERATION", "false", "experimental: move an app's sends into the tunnel's socket directly (sockops + sk_msg) instead of through the TCP stack; apps doing blocking reads may get spurious EAGAIN (see BENCHMARKS.md)"),
		cgroupRoot:     s.add("cgroup-root", "CGROUP_ROOT", "", "the cgroup v2 directory that holds the pods' cgroups, where the agent's sock_ops programs attach (empty: this process's cgroup v2 mount, which in a container is the container's own; the Helm chart mounts the host's at /host/sys/fs/cgroup)"),
		podsCgroup:     s.add("host-probe-pod-cgroup", probe.EnvPodsCgroup, "", "the cgroup above every pod's cgroup (kubelet's kubepods), as a path in --cgroup-root's cgroup v2 hierarchy (e.g. /kubepods.slice): a connection to a pod from a process below it (a hostNetwork pod) is not taken for a kubelet probe, so it meets STRICT like any other plaintext (empty: the kubepods cgroup above the agent's own when it runs in a pod, else kubepods.slice or kubepods at the hierarchy's top, and off if none is found; none: off, every process of the node's network namespace probes, as under Istio)"),
		localRoute:     s.add("local-route", "LOCAL_ROUTE", "true", "route the app socket of an established captured connection over lo to the tunnel's socket (a sock_ops program on --cgroup-root) instead of every packet through the pod interface's programs; false keeps every packet on that path"),
		replyPoll:      s.add("reply-poll", "REPLY_POLL", "0", "how long the tunnel may keep a thread awake after it delivered a small request or response to an app that answered the one before within five times that, polling for the answer instead of waiting to be woken (0: never, the default; e.g. 50us; at most 1ms; see BENCHMARKS.md)"),
		replyPollCPU:   s.add("reply-poll-cpu", "REPLY_POLL_CPU", "0.25", "the share of one CPU the agent may spend on --reply-poll, from 0 (exclusive) to 1"),
		ca:             addCAFlags(s),
		xds:            addXDSFlags(s),
		procDir:        s.add("proc-dir", "PROC_DIR", "/proc", "where the host's /proc is mounted: pods that existed before the agent are found in <dir>/<pid>/ns/net, and pods' per-namespace sysctls are written under <dir>/sys (the Helm chart mounts it read-write at /host/proc instead of using hostPID or a privileged container)"),
		cniSocket:      s.add("cni-socket", "CNI_SOCKET", "", "unix socket where redirector-cni reports new pods (empty: no CNI events; the Helm chart sets "+cni.DefaultSocketPath+")"),
		handoverSocket: s.add("handover-socket", "HANDOVER_SOCKET", "", "unix socket over which an agent passes its pods' listeners to the agent replacing it on the node, for upgrades that lose no connection (empty: none, and a successor waits for the ports until this agent exits; the Helm chart sets "+defaultHandoverSocket+")"),
		limits:         addLimitSettings(s),
		seriesGrace: s.add("metrics-series-grace", "METRICS_SERIES_GRACE", "5m",
			"istio_tcp_* series of workloads that left are deleted this long after their last connection closed"),
		telemetry: addTelemetrySettings(s),
		dns:       addDNSSettings(s),
	}
}

func parseRunFlags(args []string) (agentConfig, error) {
	s, f := runSettings()
	if err := s.parse(args); err != nil {
		return agentConfig{}, err
	}
	if err := s.require(f.node, f.src); err != nil {
		return agentConfig{}, err
	}
	if err := checkNames(s, f); err != nil {
		return agentConfig{}, err
	}
	var err error
	c := agentConfig{node: *f.node, kubeconfig: *f.kubeconfig, cniSocket: *f.cniSocket, handoverSocket: *f.handoverSocket, procDir: *f.procDir, accel: *f.accel == "true", caDir: *f.caDir, trustDomain: *f.td, bpfRoot: *f.bpfRoot,
		metricsAddr: *f.metrics, readinessAddr: *f.ready, readinessSocket: *f.readySocket, adminAddr: *f.admin, rootNamespace: *f.rootNS, data: loader.DefaultSettings()}
	c.data.ProcDir = c.procDir
	switch {
	case *f.src == "kubernetes", *f.src == "xds":
		c.source = *f.src
	case strings.HasPrefix(*f.src, "file:") && len(*f.src) > len("file:"):
		c.source = strings.TrimPrefix(*f.src, "file:")
	default:
		return c, fmt.Errorf("%s: %q is neither file:PATH nor kubernetes (nor xds)", s.name(f.src), *f.src)
	}
	if err := identity.ValidateTrustDomain(*f.td); err != nil {
		return c, fmt.Errorf("%s: %w", s.name(f.td), err)
	}
	if c.ca, err = parseCAFlags(s, f.ca, f.caDir); err != nil {
		return c, err
	}
	if c.xds, err = parseXDSFlags(s, f.xds, c, *f.ownNS); err != nil {
		return c, err
	}
	// Only EXCLUDE_NAMESPACES, as istio-cni's excludeNamespaces: the
	// agent's own namespace (istio-system) is meshed when it is labelled
	// ambient, as Istio does; the agent's own pods use the host network.
	if c.selection, err = selection.ParseConfig(*f.exclude, *f.skipRC); err != nil {
		return c, err
	}
	durations := []struct {
		dst *time.Duration
		val *string
	}{{&c.certTTL, f.ttl}, {&c.reconcilePeriod, f.period}, {&c.drainTimeout, f.drain}, {&c.poolIdle, f.poolIdle}, {&c.seriesGrace, f.seriesGrace}}
	for _, d := range durations {
		if *d.dst, err = time.ParseDuration(*d.val); err != nil || *d.dst <= 0 {
			return c, fmt.Errorf("%s: %q is not a positive duration such as 30s", s.name(d.val), *d.val)
		}
	}
	if err := s.checkPortsApart(f.metrics, f.ready, f.admin); err != nil {
		return c, err
	}
	if err := s.checkPaths(f.procDir, f.bpfRoot); err != nil {
		return c, err
	}
	if c.cgroupRoot = *f.cgroupRoot; c.cgroupRoot != "" {
		if err := s.checkPaths(f.cgroupRoot); err != nil {
			return c, err
		}
	}
	socks := []*string{f.cniSocket, f.handoverSocket, f.readySocket}
	socketWhat := []string{"CNI socket", "hand-over socket", "readiness socket"} // as their servers name them
	for i, sock := range socks {
		if err := checkSocketPath(*sock); err != nil {
			return c, fmt.Errorf("%s: %w", s.name(sock), err)
		}
		// Before anything is taken over: the readiness socket is served
		// only once the agent has claimed the node and taken the pods'
		// listeners, and an agent failing then left the node to no one.
		if *sock != "" {
			if err := unixsock.Check(socketWhat[i], *sock); err != nil {
				return c, fmt.Errorf("%s: %w", s.name(sock), err)
			}
		}
		// Each agent renames its socket over the path: one would replace the other.
		for _, other := range socks[:i] {
			if *sock != "" && *sock == *other {
				return c, fmt.Errorf("%s: %q is also %s: the sockets need paths of their own", s.name(sock), *sock, s.name(other))
			}
		}
	}
	if c.reconcilePeriod < time.Second {
		return c, fmt.Errorf("%s: %s is shorter than the 1s minimum (every pass checks every pod)", s.name(f.period), c.reconcilePeriod)
	}
	if c.certTTL < 2*time.Minute || c.certTTL > maxCertTTL {
		return c, fmt.Errorf("%s: %s is not from the 2m minimum to the %s maximum", s.name(f.ttl), c.certTTL, maxCertTTL)
	}
	if c.poolMaxStreams, err = strconv.Atoi(*f.maxStreams); err != nil || c.poolMaxStreams < 1 {
		return c, fmt.Errorf("%s: %q is not a positive integer", s.name(f.maxStreams), *f.maxStreams)
	}
	if c.poolConns, err = strconv.Atoi(*f.poolConns); err != nil || c.poolConns < 1 || c.poolConns > maxPoolConnsPerKey {
		return c, fmt.Errorf("%s: %q is not an integer from 1 to %d", s.name(f.poolConns), *f.poolConns, maxPoolConnsPerKey)
	}
	if c.limits, err = f.limits(); err != nil {
		return c, err
	}
	if c.hboneCongestion = *f.hboneCC; c.hboneCongestion != "" {
		if err := netns.CheckCongestion(c.hboneCongestion); err != nil {
			return c, fmt.Errorf("%s: %w", s.name(f.hboneCC), err)
		}
	}
	for _, b := range []*string{f.accel, f.localRoute} {
		if *b != "true" && *b != "false" {
			return c, fmt.Errorf("%s: %q is not true or false", s.name(b), *b)
		}
	}
	c.localRoute = *f.localRoute == "true"
	if c.replyPoll.Window, err = time.ParseDuration(*f.replyPoll); err != nil {
		return c, fmt.Errorf("%s: %q is not a duration", s.name(f.replyPoll), *f.replyPoll)
	}
	// Checked with polling off too: a bad value must not wait until
	// someone turns polling on to be found.
	if c.replyPoll.CPU, err = strconv.ParseFloat(*f.replyPollCPU, 64); err != nil || !(c.replyPoll.CPU > 0 && c.replyPoll.CPU <= 1) {
		return c, fmt.Errorf("%s: %q is not a share of one CPU, more than 0 and at most 1", s.name(f.replyPollCPU), *f.replyPollCPU)
	}
	if err := hbone.CheckReplyPoll(c.replyPoll); err != nil {
		return c, fmt.Errorf("%s, %s: %w", s.name(f.replyPoll), s.name(f.replyPollCPU), err)
	}
	switch *f.tcMode {
	case "auto", "tcx":
	case "legacy":
		c.legacyTC = true
	default:
		return c, fmt.Errorf("%s: %q is not auto, tcx or legacy", s.name(f.tcMode), *f.tcMode)
	}
	if c.telemetry, err = f.telemetry.parse(s); err != nil {
		return c, err
	}
	if c.dns, err = f.dns.parse(s); err != nil {
		return c, err
	}
	// Only the names, as POST /logging takes them: slog's own parser also
	// took offsets ("info+2", "debug-100") that name no level the agent
	// logs at.
	var ok bool
	if c.logLevel, ok = admin.ParseLevel(*f.logLevel); !ok {
		return c, fmt.Errorf("%s: %q is not debug, info, warn or error", s.name(f.logLevel), *f.logLevel)
	}
	if c.data.ProbeSNATv4, c.data.ProbeSNATv6, err = probe.ParseSNAT(*f.probe4, *f.probe6); err != nil {
		return c, err
	}
	if c.podsCgroup, c.podsCgroupFound, err = probe.FindPodsCgroup(c.cgroupRoot, *f.podsCgroup); err != nil {
		return c, err
	}
	return c, nil
}

// checkNames refuses a setting that names something (this node, a
// namespace, the agent's pod, the cluster) and cannot be such a name. Taken
// as given it matched nothing, silently: a ROOT_NAMESPACE with a stray
// space or newline made the mesh-wide policies apply nowhere (a STRICT mesh
// took plaintext), a NODE_NAME enrolled none of the node's pods, a POD_NAME
// with a "~" broke the node id istiod parses.
func checkNames(s *settings, f runFlags) error {
	for _, n := range []struct {
		val  *string
		kind string
		// optional: empty means the default.
		optional bool
		check    func(string) []string
	}{
		{f.node, "node name", false, validation.IsDNS1123Subdomain},
		{f.rootNS, "namespace name", false, validation.IsDNS1123Label},
		{f.ownNS, "namespace name", true, validation.IsDNS1123Label},
		{f.xds.podName, "pod name", true, validation.IsDNS1123Subdomain},
		// The cluster goes to istiod in a gRPC header of every certificate
		// request (a control or non-ASCII character failed each one at run
		// time) and to peers in the baggage of every CONNECT, which a peer
		// leaves out when it is not a plain name of at most 63 characters
		// (with it the source_cluster label of its metrics).
		{f.ca.clusterID, "cluster name (a label value)", true, validation.IsValidLabelValue},
	} {
		if n.optional && *n.val == "" {
			continue
		}
		if errs := n.check(*n.val); len(errs) > 0 {
			return fmt.Errorf("%s: %q is not a %s: %s", s.name(n.val), *n.val, n.kind, errs[0])
		}
	}
	return nil
}

func runAgent(ctx context.Context, args []string) error {
	cfg, err := parseRunFlags(args)
	if err != nil {
		return err
	}
	level := new(slog.LevelVar)
	level.Set(cfg.logLevel)
	log := slog.New(cfg.telemetry.logHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("node", cfg.node)
	slog.SetDefault(log)

	certs, closeCerts, err := newCertManager(ctx, cfg, log)
	if err != nil {
		return err
	}
	defer closeCerts()

	// The agent this one replaces, if it still runs, gives each pod's
	// listeners over (tunnel/handover.go): connect before serving any pod,
	// and before this agent puts its own socket at the path.
	var pred *tunnel.Predecessor
	if cfg.handoverSocket != "" {
		if pred, err = tunnel.DialPredecessor(ctx, cfg.handoverSocket); err != nil {
			log.Warn("no listener hand-over: the pods' ports are taken when the agent holding them lets go", "error", err)
		} else if pred != nil {
			log.Info("connected to the running agent's hand-over socket: taking its pods' listeners", "socket", cfg.handoverSocket)
		}
	}
	// An upgrade overlaps two agents on the node. This one takes the node
	// over (it changes the enrollment and points the pinned links at its
	// programs, and an older one still running stops doing so) only once
	// its source delivered state to apply (nodeagent.Config.TakeNode):
	// until then the older agent, with the last good state, goes on. With
	// no older agent to hand over from (a node's first start, a restart
	// after a crash, no hand-over socket) nobody has better state, and it
	// takes the node at once.
	deferTake := pred != nil
	logPodsCgroup(ctx, log, cfg)
	ld, err := loader.Load(ctx, loader.Config{PinRoot: cfg.bpfRoot, Settings: cfg.data, ForceLegacyTC: cfg.legacyTC,
		CgroupPath: cfg.cgroupRoot, PodsCgroupID: cfg.podsCgroup.ID, PacketPathOnly: !cfg.localRoute, DeferRelink: deferTake, Logger: log})
	if err != nil {
		return err
	}
	defer ld.Close()
	claim, err := maps.NewClaim(cfg.bpfRoot, log)
	if err != nil {
		return err
	}
	defer claim.Close()
	ld.SetClaim(claim)
	if !deferTake {
		// The links are pointed at this agent's programs again under the
		// claim's lock: an older agent taking the node back (a rollback)
		// may have pointed them at its own since Load.
		if err := claim.Take(ctx, func() { ld.Relink(ctx) }); err != nil {
			return err
		}
	}
	// However this agent stops, an older one still running beside it (an
	// upgrade rolled back, this start failed) takes the node back.
	releaseClaim := sync.OnceFunc(func() { giveNodeUp(ctx, claim, log) })
	defer releaseClaim()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	var wrapPodSocket func(net.Conn) net.Conn
	var acc *accel.Accelerator
	if cfg.accel {
		acc, err = accel.Load(ctx, accel.Config{PinRoot: cfg.bpfRoot, CgroupPath: cfg.cgroupRoot, TunnelMark: cfg.data.TunnelMark, MarkMask: cfg.data.MarkMask, HBONEPort: cfg.data.HBONEPort, DeferRelink: deferTake, Logger: log})
		if err != nil {
			return fmt.Errorf("--sockops-acceleration (SOCKOPS_ACCELERATION): %w", err)
		}
		defer acc.Close()
		wrapPodSocket = acc.Wrap
		reg.MustRegister(acc.Collector())
	} else if !deferTake {
		// A previous run had it on: turn it off, as the setting says
		// (relinkNode does, with a deferred take).
		if err := accel.Uninstall(cfg.bpfRoot); err != nil {
			log.Warn("remove sockops acceleration", "error", err)
		}
	}

	if err := hbone.SetReplyPoll(cfg.replyPoll); err != nil {
		return err
	}
	pool := hbone.NewPool(hbone.PoolOptions{MaxStreamsPerConn: cfg.poolMaxStreams, ConnsPerKey: cfg.poolConns, IdleTimeout: cfg.poolIdle, Logger: log})
	defer pool.Close()
	// Access logs go to stderr too, batched (see tunnel.AccessLogWriter).
	accessOut := tunnel.NewAccessLogWriter(os.Stderr)
	defer accessOut.Close()
	accessLog := slog.New(cfg.telemetry.logHandler(accessOut, &slog.HandlerOptions{Level: level})).With("node", cfg.node)
	tunMetrics := tunnel.NewMetrics(reg)
	tunMetrics.SetSeriesGrace(cfg.seriesGrace)
	tunMetrics.SetCluster(cfg.ca.clusterID)
	drainMetrics := tunnel.NewDrainMetrics(reg)
	var tun *tunnel.Tunnel
	dns, err := newDNSProxy(cfg.dns, func() *workload.Directory { return tun.State().Dir }, reg, log)
	if err != nil {
		return err
	}
	tun = tunnel.New(tunnel.Config{
		TrustDomain: cfg.trustDomain, RootNamespace: cfg.rootNamespace,
		DNS: dns, DNSPort: cfg.data.DNSPort, DNSCapture: cfg.dns.capture,
		OutboundPort: cfg.data.OutboundPort, InboundPort: cfg.data.InboundPort, HBONEPort: cfg.data.HBONEPort,
		TunnelMark: cfg.data.TunnelMark, Predecessor: pred, WrapPodSocket: wrapPodSocket, Certs: certs, Pool: pool, Metrics: tunMetrics, Logger: log,
		Limits: cfg.limits, NoAccessLog: !cfg.telemetry.accessLog, AccessLogger: accessLog, HBONECongestion: cfg.hboneCongestion,
	})
	// The path stays the predecessor's until it is gone; this agent's own
	// socket goes there once it holds the node (serveHandover, below).
	if pred != nil {
		go func() {
			pred.WaitGone(ctx, 2*ownPathCheck)
			if ctx.Err() == nil {
				log.Info("the predecessor agent is gone; serving the hand-over socket once this agent holds the node")
			}
		}()
	}
	rec := nodeagent.NewReconciler(ld, tun, netns.NewIndex(&netns.Finder{NetNSDirs: netns.DefaultFinder().NetNSDirs, ProcDir: cfg.procDir}), log)
	// Link repair runs while this agent holds the node: stopped when a
	// newer agent takes it over, started again if it gives it back.
	var repairMu sync.Mutex
	stopRepair := func() {}
	startRepair := func() {
		repairMu.Lock()
		defer repairMu.Unlock()
		stopRepair()
		repairCtx, cancel := context.WithCancel(ctx)
		stopRepair = cancel
		go rec.RepairLinks(repairCtx, nodeagent.LinkCheckPeriod)
	}
	endRepair := func() {
		repairMu.Lock()
		defer repairMu.Unlock()
		stopRepair()
	}
	defer endRepair()
	reg.MustRegister(
		loader.NewCollector(ld),
		nodeagent.NewCollector(rec),
		certs.Collector(),
		maps.NewCollector(ld.Maps()),
		admin.NewAgentCollector(func() (runs, errs, repairs uint64, enrolled int) {
			st := rec.Stats()
			return st.Runs, st.Errors, st.Repairs, st.Enrolled
		}),
		admin.NewCertCollector(func() []admin.CertRow { return certExpiryRows(certs) }),
		admin.NewZtunnelCollector(version, func() (active, pending int) {
			for _, w := range tun.State().Dir.LocalPods(cfg.node) {
				switch {
				case tun.PodReady(w.Key()):
					active++
				case w.Enrolled:
					pending++
				}
			}
			return active, pending
		}),
		admin.NewPoolCollector(func() admin.PoolStats {
			st := pool.Stats()
			return admin.PoolStats{Conns: st.Conns, ActiveStreams: st.ActiveStreams, Dials: st.DialsTotal, FloodCloses: st.FloodCloses,
				ZeroStreamLimitDrains: st.ZeroStreamLimitDrains, ProtocolErrorCloses: st.ProtocolErrorCloses,
				OwnCertificateDrains: st.OwnCertificateDrains}
		}),
		admin.NewBufferCollector(func() admin.BufferStats {
			b, w := hbone.Buffers(), hbone.Windows()
			return admin.BufferStats{Limit: b.Limit, FramesInUse: b.FramesInUse, BatchesInUse: b.BatchesInUse,
				FramesDenied: b.FramesDenied, BatchesDenied: b.BatchesDenied,
				FramesDeniedShare: b.FramesDeniedShare, BatchesDeniedShare: b.BatchesDeniedShare,
				WindowReserved: w.Reserved, WindowLimit: w.Limit, WindowsShort: w.Short,
				WindowsReclaimed: w.Reclaimed}
		}),
		admin.NewReplyPollCollector(func() admin.ReplyPollStats {
			p := hbone.ReplyPolls()
			return admin.ReplyPollStats{Caught: p.Caught, Tunnel: p.Tunnel, Expired: p.Expired,
				Budget: p.Budget, Busy: p.Busy, Seconds: p.Spent.Seconds()}
		}),
		admin.NewServerCollector(func() admin.ServerStats {
			st, lim := tun.HBONEStats(), tun.HBONELimits()
			return admin.ServerStats{HandshakeFailures: st.HandshakeFailures, StreamsOK: st.StreamsOK,
				StreamsBadRequest: st.StreamsBadRequest, StreamsDenied: st.StreamsDenied, StreamsRefused: st.StreamsRefused,
				EarlyResets: st.StreamsEarlyReset, FloodCloses: st.ConnsFlood, ProtocolErrorCloses: st.ConnsProtocolError, AcceptErrors: st.AcceptErrors, RefusalsCut: st.RefusalsCut,
				WriteStallCloses: st.ConnsWriteStalled, HandlersHeld: st.HandlersHeld, HandlersQueued: st.HandlersQueued,
				OpenConns: lim.Conns, Handshakes: lim.Handshakes, RefusedConns: lim.RefusedConns, RefusedHandshakes: lim.RefusedHandshakes,
				RefusedHandshakeRate: lim.RefusedHandshakeRate,
				EvictedHandshakes:    lim.EvictedHandshakes, EvictedConns: lim.EvictedConns, SourceResetFloods: lim.SourceResetFloods,
				SourceHandlerRefusals: lim.RefusedHandlers, OwnCertificateDrains: st.OwnCertificateDrains}
		}),
	)

	registerListenerDrops(reg, tun)

	src, ann, err := newSource(ctx, cfg, log, reg, source.NewMetrics(reg), certs.Trust())
	if err != nil {
		return err
	}
	// The readiness server is closed when a newer agent takes the node over:
	// probes of the shared readiness port must reach the successor. It is
	// served again, with the CNI socket installed again over the newer
	// agent's, if that one gives the node back.
	var servers *admin.Servers
	cniReinstall := make(chan struct{}, 1)
	// Closed once this agent holds the node: its CNI socket goes to the
	// path only then, and until then the agent holding the node, with the
	// last good state, answers the plugin.
	nodeTaken := make(chan struct{})
	var takeNode func(context.Context) error
	if deferTake {
		// The pinned state is read again, and the links pointed at this
		// agent's programs, under the claim's lock: the older agent went on
		// changing the node since Load.
		takeNode = func(ctx context.Context) error {
			if err := claim.Take(ctx, func() { relinkNode(ctx, cfg, ld, acc, log) }); err != nil {
				return err
			}
			startRepair()
			close(nodeTaken)
			return nil
		}
	} else {
		startRepair()
		close(nodeTaken)
	}
	agent := nodeagent.New(nodeagent.Config{
		Node: cfg.node, TrustDomain: cfg.trustDomain, Selection: cfg.selection, DNSCapture: cfg.dns.capture, CNISocket: cfg.cniSocket, ProcDir: cfg.procDir,
		ReconcilePeriod: cfg.reconcilePeriod, Tunnel: tun, Loader: ld, Reconciler: rec, Certs: certs, Registry: reg, Logger: log,
		Claim:     takeBackClaim{claim, func(ctx context.Context) { relinkNode(ctx, cfg, ld, acc, log) }},
		TakeNode:  takeNode,
		Annotator: annotator(ann),
		OnYield: func() {
			endRepair()
			_ = servers.CloseReadiness()
		},
		OnReclaim: func() {
			// The pinned state was read again, and the links pointed back
			// at this agent's programs, as the node was taken back
			// (takeBackClaim).
			startRepair()
			select {
			case cniReinstall <- struct{}{}:
			default:
			}
			if err := servers.ReopenReadiness(ctx); err != nil {
				log.Error("readiness endpoint not served again after taking the node back; retrying in the background", "error", err)
			}
		},
	})
	defer agent.Close()
	cniReady := admin.Check(func() (bool, string) { return true, "" })
	if cfg.cniSocket != "" {
		srv := cni.NewServer(cfg.cniSocket, agent.HandleCNI, log)
		reg.MustRegister(
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "redirector_cni_open_connections", Help: "Connections open on the CNI event socket."},
				func() float64 { return float64(srv.Stats().Open) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "redirector_cni_refused_peers_total", Help: "Connections to the CNI event socket closed unread: the peer was neither root nor the agent's user."},
				func() float64 { return float64(srv.Stats().RefusedPeers) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "redirector_cni_waited_connections_total", Help: "Connections to the CNI event socket that waited for a slot (at most 512 open)."},
				func() float64 { return float64(srv.Stats().Waited) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "redirector_cni_invalid_events_total", Help: "CNI events refused unhandled: undecodable, or with a field no runtime sends (the error names it)."},
				func() float64 { return float64(srv.Stats().Invalid) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "redirector_cni_pod_reports", Help: "Pod sandboxes the CNI plugin reported whose network namespace still exists (at most one a namespace)."},
				func() float64 { return float64(agent.CNIReports()) }),
		)
		// Before the socket: while the agent starts after a reboot (no
		// hint on tmpfs), kube-system's pods must not wait for its source.
		agent.WriteStartupHint()
		cniReady = serveCNI(ctx, srv, cniRetryPeriod, nodeTaken, cniReinstall, claim.Held, log)
	}
	if cfg.handoverSocket != "" {
		var gone <-chan struct{}
		if pred != nil {
			gone = pred.Gone()
		}
		serveHandover(ctx, tun.HandoverServer(cfg.handoverSocket), cniRetryPeriod, gone, nodeTaken, claim.Held, log)
	}
	// Ready: the BPF objects are loaded (Load returned), the first full
	// reconcile finished, every enrolled pod has its listeners and a valid
	// certificate, and no shutdown has begun.
	servers, err = admin.Start(ctx, admin.Options{
		MetricsAddr: cfg.metricsAddr, ReadinessAddr: cfg.readinessAddr, ReadinessSocket: cfg.readinessSocket, AdminAddr: cfg.adminAddr,
		Registry: reg,
		Ready: admin.AllReady(
			func() (bool, string) { return ctx.Err() == nil, "shutting down" },
			func() (bool, string) {
				if err := ld.Healthy(); err != nil {
					return false, "BPF objects: " + err.Error()
				}
				return true, ""
			},
			agent.Reconciled,
			sourceSynced(src),
			func() (bool, string) { return podsReady(cfg, tun, certs) },
			admin.ProblemsCheck(tun.ListenerProblems),
			cniReady,
		),
		Sections: configSections(cfg, tun, certs),
		Level:    level,
		Logger:   log,
		Listen:   endpointListen(cfg, pred, log),
	})
	if err != nil {
		return err
	}
	defer servers.Close()
	if cfg.handoverSocket != "" {
		tun.ShareEndpoints(servers.Listener)
		if pred != nil {
			// Sockets bound beside a predecessor that did not hand them
			// over (or handed ones it had so bound) take their ports alone
			// once it is gone.
			go func() {
				select {
				case <-ctx.Done():
				case <-pred.Gone():
					if err := servers.OwnPorts(ctx); err != nil {
						log.Error("HTTP endpoints: binding alone after the predecessor left failed", "error", err)
					}
				}
			}()
		}
	}

	log.Info("agent started", "source", cfg.source, "bpf_root", cfg.bpfRoot, "trust_domain", cfg.trustDomain)
	runErr := agent.Run(ctx, src)
	// No more enrollment changes here: give the node back before the drain.
	releaseClaim()
	if runErr != nil {
		return fmt.Errorf("source %s: %w", cfg.source, runErr)
	}
	if ctx.Err() == nil {
		return nil // the source ended
	}
	// Listeners close first (a successor holding the same sockets takes the
	// new connections and the requests queued on them), HBONE peers get
	// GOAWAY, open connections run until the drain timeout.
	log.Info("shutting down: draining connections, leaving redirection pinned", "timeout", cfg.drainTimeout)
	dctx, cancel := context.WithTimeout(context.Background(), cfg.drainTimeout)
	defer cancel()
	res := tun.Drain(dctx, drainMetrics)
	log.Info("drained", "pods", res.Pods, "open_connections", res.Open, "finished", res.Finished, "closed_at_timeout", res.Closed)
	return nil
}

// takeBackClaim is the node's claim as the node agent sees it: taking the
// node back from a newer agent that gave it up relinks the node (relink)
// under the claim's exclusive lock, before anything else of this agent or
// another changes the pinned state.
type takeBackClaim struct {
	*maps.Claim
	relink func(context.Context)
}

// Reclaim implements the node agent's take-back.
func (c takeBackClaim) Reclaim(ctx context.Context) (bool, error) {
	return c.ReclaimThen(ctx, func() { c.relink(ctx) })
}

// relinkNode points every pinned link of the node back at this agent's
// programs, as its start did: the loader's (pods, host probes, local
// routing) and the acceleration's, or removes the acceleration when this
// agent runs without it (the newer agent may have run with it).
func relinkNode(ctx context.Context, cfg agentConfig, ld *loader.Loader, acc *accel.Accelerator, log *slog.Logger) {
	ld.Relink(ctx)
	if acc != nil {
		if err := acc.Relink(); err != nil {
			log.ErrorContext(ctx, "sockops acceleration: this agent's programs not attached again as it took the node", "error", err)
		}
	} else if err := accel.Uninstall(cfg.bpfRoot); err != nil {
		log.WarnContext(ctx, "remove sockops acceleration", "error", err)
	}
}

// giveNodeUp releases this agent's claim on the node as it stops
// (maps.Claim.Release), waiting at most releasePatience for the pin root's
// lock: an older agent still running takes the node back.
func giveNodeUp(ctx context.Context, claim *maps.Claim, log *slog.Logger) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releasePatience)
	defer cancel()
	if err := claim.Release(rctx); err != nil {
		log.Warn("node not given up: an older agent still running stays yielded", "error", err)
	}
}

// releasePatience bounds giveNodeUp's wait for the pin root's lock.
const releasePatience = 10 * time.Second

// serveCNI serves the CNI event socket until ctx ends, and returns a
// readiness check that fails, with the error, while it does not: a socket
// the agent cannot serve (a directory others may write, something else at
// the path) was logged once, and the agent went on ready while every ADD
// of an ambient pod failed as if it were down (a surge upgrade retired
// the old agent, which still served). The agent does not exit for it: its
// enrolled pods keep their tunnel. Serving is tried again every retry, so
// a directory put right is taken without a restart.
//
// It serves once taken is closed (nil: at once), when this agent holds the
// node: an agent that installed its socket as it started took the plugin's
// events from the agent holding the node before it had any state of its
// own. The path follows the agent holding the node (nodeSocket): before,
// an agent that yielded the node (one of two new agents racing, slower to
// install than to claim) could put its socket over the holder's and
// remove it as it stopped, and every CNI ADD on the node failed from then
// on while the holder passed for ready. A value on reinstall (nil: none)
// serves the socket anew, installed over whatever is at the path: the
// agent took the node back from a newer one, whose socket was put over
// this one's (see OnReclaim).
func serveCNI(ctx context.Context, srv *cni.Server, retry time.Duration, taken, reinstall <-chan struct{}, held func() bool, log *slog.Logger) admin.Check {
	return nodeSocket{sock: srv, what: "CNI event socket", setting: "--cni-socket (CNI_SOCKET)", retry: retry,
		after: []<-chan struct{}{taken}, reinstall: reinstall, held: held}.serve(ctx, log)
}

// serveHandover serves the listener hand-over socket until ctx ends, as
// serveCNI the CNI socket: once the predecessor is gone (gone, nil: none)
// and this agent took the node (taken), and only while it holds it (held).
// Before, the socket went to the path as soon as the predecessor was gone,
// held or not: of two new agents racing for the node, both waiting for
// the old agent's socket to go, the one that yielded could install last,
// and removed the path as it stopped; the next agent then found no
// predecessor and bound the pods' ports beside the holder, which failed
// until the holder exited (SYNs in that gap were sent again). Not a
// readiness check: a successor waits for its predecessor to go before it
// serves, and the predecessor goes only once the successor is ready.
func serveHandover(ctx context.Context, hs *tunnel.HandoverServer, retry time.Duration, gone, taken <-chan struct{}, held func() bool, log *slog.Logger) {
	nodeSocket{sock: hs, what: "listener hand-over socket", setting: "--handover-socket (HANDOVER_SOCKET)", retry: retry,
		unserved: " (an agent replacing this one waits for the pods' ports until this one exits)",
		after:    []<-chan struct{}{gone, taken}, held: held}.serve(ctx, log)
}

// endpointListen opens the HTTP endpoints' listeners in the node's
// namespace. No socket there is in a reuseport group while it can help it:
// any process of the agent's user (a hostNetwork container running as
// root) could join one and take a share of kubelet's probes, the scrapes
// and admin calls (admin.ListenAlone). A predecessor's sockets are taken
// over through the hand-over socket; one that does not hand them over (a
// release before this) has them in a reuseport group, which this agent
// joins until it is gone (Servers.OwnPorts). Without a hand-over socket
// there is no other way for a successor to start beside this agent, and
// the endpoints stay shared, as the warning says.
func endpointListen(cfg agentConfig, pred *tunnel.Predecessor, log *slog.Logger) func(ctx context.Context, name, addr string) (net.Listener, error) {
	return func(ctx context.Context, name, addr string) (net.Listener, error) {
		if cfg.handoverSocket == "" {
			log.Warn("no hand-over socket: the HTTP endpoint binds with SO_REUSEPORT so that a successor can bind beside it; any process of this user in the node's network namespace can join its port", "endpoint", name, "addr", addr)
			return admin.ListenShared(ctx, addr)
		}
		if pred == nil {
			return admin.ListenAlone(ctx, addr)
		}
		l, err := pred.TakeEndpoint(ctx, name, addr)
		if l != nil {
			log.Info("HTTP endpoint socket taken over from the predecessor", "endpoint", name, "addr", addr)
			return l, nil
		}
		if err != nil {
			log.Warn("HTTP endpoint socket not taken over from the predecessor (another address, or the exchange failed); binding beside it until it is gone", "endpoint", name, "addr", addr, "error", err)
		}
		select {
		case <-pred.Gone():
			return admin.ListenAlone(ctx, addr)
		default:
			return admin.ListenShared(ctx, addr)
		}
	}
}

// maxSocketPath bounds CNI_SOCKET and HANDOVER_SOCKET: a unix socket's
// name has at most 107 bytes, and the server binds "<path>.<7 hex digits>.tmp"
// first (unixsock.Install) before renaming it over the path.
const maxSocketPath = 107 - len(".0000000.tmp")

// defaultHandoverSocket is the chart's HANDOVER_SOCKET, next to the CNI
// socket in the directory both agents of an upgrade mount.
const defaultHandoverSocket = "/var/run/redirector/handover.sock"

// checkSocketPath refuses a socket path the agent could never serve, or
// another process (the CNI plugin, run by the runtime in a directory of its
// own; a successor agent) find: a relative or unclean path, or one too long
// for a unix socket.
func checkSocketPath(path string) error {
	if path == "" {
		return nil
	}
	if err := checkCleanPath(path); err != nil {
		return err
	}
	if len(path) > maxSocketPath {
		return fmt.Errorf("%q has %d bytes, more than the %d a unix socket's name leaves it", path, len(path), maxSocketPath)
	}
	return nil
}

// cniRetryPeriod is how long serveCNI and serveHandover wait before
// serving again.
const cniRetryPeriod = 5 * time.Second

// annotator is ann as the node agent takes it: nil (not a nil pointer in
// an interface) when the source has no API server to annotate.
func annotator(ann *kubernetes.Annotator) nodeagent.Annotator {
	if ann == nil {
		return nil
	}
	return ann
}

// newSource returns the configured source, and for Kubernetes the
// annotator that marks redirected pods.
func newSource(ctx context.Context, cfg agentConfig, log *slog.Logger, reg prometheus.Registerer, metrics *source.Metrics, trust identity.Trust) (source.Source, *kubernetes.Annotator, error) {
	if cfg.source == "xds" {
		return newXDSSource(ctx, cfg, log, reg, metrics, trust)
	}
	if cfg.source != "kubernetes" {
		if _, err := os.Stat(cfg.source); err != nil {
			return nil, nil, fmt.Errorf("--source (SOURCE): %w", err)
		}
		return kubeobj.NewSource(file.New(cfg.source, log).WithMetrics(metrics), cfg.selection, log), nil, nil
	}
	rc, err := restConfig(cfg.kubeconfig)
	if err != nil {
		return nil, nil, err
	}
	ks, err := kubernetes.New(kubernetes.Config{RestConfig: rc, NodeName: cfg.node, Logger: log, Metrics: metrics, Selection: cfg.selection})
	if err != nil {
		return nil, nil, fmt.Errorf("kubernetes source: %w", err)
	}
	ann, err := kubernetes.NewAnnotator(rc)
	if err != nil {
		return nil, nil, fmt.Errorf("kubernetes annotator: %w", err)
	}
	return ks, ann, nil
}

// logPodsCgroup says who passes as kubelet's probes on this node: with no
// pods' cgroup, hostNetwork pods do too.
func logPodsCgroup(ctx context.Context, log *slog.Logger, cfg agentConfig) {
	switch {
	case cfg.podsCgroup.ID != 0:
		log.InfoContext(ctx, "host probes: connections from processes below the pods' cgroup (hostNetwork pods) are not probes", "cgroup", cfg.podsCgroup.Dir)
	case cfg.podsCgroupFound:
		log.InfoContext(ctx, "host probes: every process of the node's network namespace probes, hostNetwork pods too", "setting", probe.EnvPodsCgroup+"="+probe.PodsCgroupOff)
	default:
		log.WarnContext(ctx, "host probes: no pods' cgroup found where kubelet puts it, so every process of the node's network namespace probes, hostNetwork pods too, past STRICT; name it with "+probe.EnvPodsCgroup,
			"cgroup_root", cfg.cgroupRoot)
	}
}

// registerListenerDrops exports what the kernel dropped at the pods'
// sockets before the agent read it: a listener's full SYN or accept queue,
// a full DNS socket. One read of the sockets per scrape.
func registerListenerDrops(reg prometheus.Registerer, tun *tunnel.Tunnel) {
	reg.MustRegister(listenerDropsCollector{tun})
}

var listenerDropsDesc = prometheus.NewDesc("redirector_listener_drops_total",
	"SYNs and handshakes the pods' capture listeners turned away because their SYN or accept queue was full (the namespaces' ListenOverflows and ListenDrops), and DNS queries the pods' DNS sockets turned away because their receive queue was full, by listener: outbound (15001), inbound (15006), hbone (15008), dns (15053).",
	[]string{"listener"}, nil)

type listenerDropsCollector struct{ tun *tunnel.Tunnel }

func (listenerDropsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- listenerDropsDesc }

func (c listenerDropsCollector) Collect(ch chan<- prometheus.Metric) {
	d := c.tun.ListenerDrops()
	for _, v := range []struct {
		name  string
		count uint64
	}{{"outbound", d.Outbound}, {"inbound", d.Inbound}, {"hbone", d.HBONE}, {"dns", d.DNS}} {
		ch <- prometheus.MustNewConstMetric(listenerDropsDesc, prometheus.CounterValue, float64(v.count), v.name)
	}
}
