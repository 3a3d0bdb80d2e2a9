package admin

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metricsHandler serves reg. A collector that fails (a BPF map that cannot
// be read) is logged and counted in promhttp_metric_handler_errors_total
// while the other metrics are still served, so one broken source does not
// blind every dashboard.
//
// A scrape reads every BPF map and series and holds its answer until it is
// written, so scrapes beyond maxScrapesInFlight at once, or beyond
// maxScrapesPerSource from one client address, are answered 503 rather
// than queued: anyone who reaches the port (every pod can) could otherwise
// make the agent spend its CPU gathering metrics, or start scrapes it
// never reads (each held to the write timeout) and leave Prometheus none.
// Answers are rendered within a CPU budget and shared (scrapeCache), so
// that asking again and again costs the agent no more than that budget.
func metricsHandler(reg *prometheus.Registry, burst time.Duration, log *slog.Logger) http.Handler {
	scrapes := newInFlight(maxScrapesInFlight, maxScrapesPerSource)
	reused := registered(reg, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "redirector_metrics_scrapes_reused_total",
		Help: "Scrapes of /metrics answered with an earlier rendering of the same format (at most 10 s old), because renderings, one at a time, had used up their share of the time (a quarter, with a few seconds of credit): someone scrapes far more often than Prometheus does.",
	}))
	render := promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:            slog.NewLogLogger(log.Handler(), slog.LevelError),
		ErrorHandling:       promhttp.ContinueOnError,
		Registry:            reg,
		AcceptedFormats:     scrapeFormats,
		OfferedCompressions: []promhttp.Compression{promhttp.Identity, promhttp.Gzip},
	})
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", scrapes.limit(
		fmt.Sprintf("busy: %d scrapes in flight at most, %d per client address; try again later", maxScrapesInFlight, maxScrapesPerSource),
		newScrapeCache(render, burst, reused.Inc)))
	return mux
}

// maxScrapesInFlight is how many scrapes are gathered and written at once:
// an HA pair of Prometheus servers and a person with curl.
// maxScrapesPerSource is how many of them one client address may have:
// two, as two scrape jobs of one Prometheus (a PodMonitor and a
// ServiceMonitor, say) or collectors behind one SNAT address may overlap;
// one address still cannot take every slot.
const (
	maxScrapesInFlight  = 4
	maxScrapesPerSource = 2
)

// inFlight bounds the requests a handler serves at once, in all and per
// client address.
type inFlight struct {
	total, perSource int

	mu    sync.Mutex
	n     int
	bySrc map[netip.Addr]int
}

func newInFlight(total, perSource int) *inFlight {
	return &inFlight{total: total, perSource: perSource, bySrc: map[netip.Addr]int{}}
}

// limit serves h within the bounds, and answers 503 with busy past them.
// A request holds its slot until h returns, its answer written.
func (f *inFlight) limit(busy string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		src := remoteAddr(r)
		if !f.acquire(src) {
			w.Header().Set("Retry-After", "1")
			http.Error(w, busy, http.StatusServiceUnavailable)
			return
		}
		defer f.release(src)
		h.ServeHTTP(w, r)
	})
}

func (f *inFlight) acquire(src netip.Addr) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.n >= f.total || f.bySrc[src] >= f.perSource {
		return false
	}
	f.n++
	f.bySrc[src]++
	return true
}

func (f *inFlight) release(src netip.Addr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n--
	if f.bySrc[src]--; f.bySrc[src] <= 0 {
		delete(f.bySrc, src)
	}
}

// remoteAddr is the client address of r (the zero address, one bucket for
// all, if the server gave none).
func remoteAddr(r *http.Request) netip.Addr {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr().Unmap()
}

// readinessHandler answers 200 only while ready says so, and 503 with the
// reason otherwise.
func readinessHandler(ready func() (bool, string)) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz/ready", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if ok, reason := ready(); !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintf(w, "not ready: %s\n", reason)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	return mux
}

// adminEndpoints are listed by GET / for whoever lands on the admin port.
var adminEndpoints = []string{
	"GET  /config_dump             workloads, services, policies, certificates, workloadState (ztunnel's shape); pods, certs, meshPolicies",
	fmt.Sprintf("GET  /debug/pprof/            Go profiles (net/http/pprof); a profile or trace runs for seconds=N, at most %d", maxProfileSeconds),
	"GET  /logging                 the current log level (POST /logging with no level too, as ztunnel)",
	"POST /logging?level=LEVEL     set the log level: error, warn, info, debug, trace or off (a comma list: the last wins)",
	"POST /logging?reset           back to the level the agent started with (LOG_LEVEL)",
}

// adminHandler serves the config dump, pprof and the log level. pprof's
// handlers are registered here explicitly: importing net/http/pprof also
// registers them on http.DefaultServeMux, which no server of the agent uses.
func adminHandler(sections map[string]func() any, level *slog.LevelVar, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, strings.Join(adminEndpoints, "\n"))
	})
	mux.Handle("GET /config_dump", configDump(sections))
	profiles := newInFlight(maxProfilesInFlight, maxProfilesInFlight)
	busy := fmt.Sprintf("pprof busy: %d profiles are being taken or written; try again later", maxProfilesInFlight)
	prof := func(pattern string, h http.HandlerFunc) { mux.Handle(pattern, profiles.limit(busy, h)) }
	prof("GET /debug/pprof/", boundProfile(pprof.Index)) // named profiles, with ?seconds= a delta
	prof("GET /debug/pprof/cmdline", pprof.Cmdline)
	prof("GET /debug/pprof/profile", boundProfile(pprof.Profile))
	prof("GET /debug/pprof/symbol", pprof.Symbol)
	prof("POST /debug/pprof/symbol", symbol) // the pprof tool posts its lookups
	prof("GET /debug/pprof/trace", boundProfile(pprof.Trace))
	mux.HandleFunc("GET /logging", showLevel(level))
	mux.HandleFunc("POST /logging", setLevel(level, level.Level(), log))
	return localOnly(mux)
}

// localOnly refuses what a web page in a browser on the node can send to
// the admin endpoint's loopback address, and serves the rest with h:
//
//   - a request whose Host is a name other than localhost (421): a page
//     whose DNS name was rebound to 127.0.0.1 is same-origin with the
//     endpoint in the browser's eyes, and could read the config dump and
//     profiles; its requests carry its own name as Host. istioctl, kubectl
//     port-forward, curl and `redirector inspect` address it by IP or as
//     localhost.
//   - a request the browser marks as cross-origin (403): Sec-Fetch-Site
//     other than same-origin or none, or without it an Origin that is not
//     the Host. A page of any site may otherwise POST a form to
//     /logging?level=off (the browser sends such a simple request without
//     asking first), or start profiles with image tags. Callers that are
//     not browsers send neither header.
func localOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !localHost(r.Host) {
			http.Error(w, fmt.Sprintf("admin endpoint: Host %q is neither an IP address nor localhost; address it as 127.0.0.1 or localhost", clip(r.Host)),
				http.StatusMisdirectedRequest)
			return
		}
		if why := crossOrigin(r); why != "" {
			http.Error(w, "admin endpoint: cross-origin request refused: "+why, http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// localHost says whether host (a Host header, with or without a port) is
// an IP address or localhost, which no DNS answer can stand for. An empty
// one (HTTP/1.0) is no browser's.
func localHost(host string) bool {
	if host == "" {
		return true
	}
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	} else {
		host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return true
	}
	return strings.EqualFold(host, "localhost")
}

// crossOrigin says why a browser would call r cross-origin, or "" if it
// would not (or r is not a browser's).
func crossOrigin(r *http.Request) string {
	switch site := r.Header.Get("Sec-Fetch-Site"); site {
	case "", "same-origin", "none":
		if site != "" {
			return ""
		}
	default:
		return fmt.Sprintf("Sec-Fetch-Site %q", clip(site))
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		return ""
	}
	if u, err := url.Parse(origin); err == nil && u.Host != "" && u.Host == r.Host {
		return ""
	}
	return fmt.Sprintf("Origin %q is not Host %q", clip(origin), clip(r.Host))
}

// boundBody stops a handler reading more than maxBodyBytes of a request's
// body: none of the endpoints takes more, and what a handler reads it may
// hold (pprof's symbol lookup holds its whole answer while it reads).
func boundBody(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, maxBodyBytes)
		h.ServeHTTP(w, r)
	})
}

// symbol answers the pprof tool's POSTed symbol lookups. The body is read
// first, within maxBodyBytes (some 5,000 addresses; profiles of Go programs
// carry their symbols and need no lookup), and one over it is refused with
// 413 rather than answered in part.
func symbol(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			http.Error(w, fmt.Sprintf("symbol lookup of more than %d bytes", tooLarge.Limit), http.StatusRequestEntityTooLarge)
			return
		}
		http.Error(w, fmt.Sprintf("reading symbol lookup: %v", err), http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	pprof.Symbol(w, r)
}

// boundProfile refuses a profile, trace or delta profile asked to run for
// more than maxProfileSeconds (or for a duration that is not a positive
// number): pprof itself runs one as long as it is asked, with the runtime's
// profiler or tracer on all along.
func boundProfile(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if v := r.URL.Query().Get("seconds"); v != "" {
			if sec, err := strconv.ParseFloat(v, 64); err != nil || !(sec > 0 && sec <= maxProfileSeconds) {
				http.Error(w, fmt.Sprintf("seconds=%s: a profile or trace on the admin endpoint runs for a positive number of seconds, at most %d seconds", v, maxProfileSeconds),
					http.StatusBadRequest)
				return
			}
		}
		h(w, r)
	}
}

// configDumpWrite bounds how long a reader may take to read a dump: each
// one holds its copy until it is written.
const configDumpWrite = time.Minute

// maxDumpsInFlight is how many config dumps are built or written at once.
const maxDumpsInFlight = 2

// maxProfilesInFlight is how many pprof answers are built or written at
// once: a profile and a trace side by side, as a person debugging asks.
const maxProfilesInFlight = 2

// configDump writes every section as one JSON object. Each section is
// marshalled on its own so that a failure names the section at fault.
//
// A dump of a large directory takes memory and CPU in proportion, and each
// copy is held until its reader has taken it: so at most maxDumpsInFlight
// dumps are built or written at once (others are answered 503), one of
// them built at a time (the other waits its turn or gives up), and a caller
// that reads its dump slowly is cut off after configDumpWrite rather than
// holding its copy for ever.
func configDump(sections map[string]func() any) http.Handler {
	dumps := newInFlight(maxDumpsInFlight, maxDumpsInFlight)
	building := make(chan struct{}, 1)
	busy := fmt.Sprintf("config dump busy: %d dumps are being built or written; try again later", maxDumpsInFlight)
	return dumps.limit(busy, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case building <- struct{}{}:
		case <-r.Context().Done():
			return
		}
		out, name, err := func() ([]byte, string, error) {
			defer func() { <-building }()
			return buildDump(sections)
		}()
		if err != nil {
			http.Error(w, fmt.Sprintf("config dump section %s: %v", name, err), http.StatusInternalServerError)
			return
		}
		_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(configDumpWrite))
		w.Header().Set("Content-Type", "application/json")
		w.Write(out) // the client is gone if this fails
	}))
}

// buildDump marshals every section, indented, or names the one that fails.
func buildDump(sections map[string]func() any) (out []byte, failed string, err error) {
	dump := make(map[string]json.RawMessage, len(sections))
	for name, section := range sections {
		b, err := marshalSection(section)
		if err != nil {
			return nil, name, err
		}
		dump[name] = b
	}
	out, err = json.MarshalIndent(dump, "", "  ")
	if err != nil {
		return nil, "", err
	}
	return append(out, '\n'), "", nil
}

// marshalSection marshals what section returns. A section that panics
// (a bug in how it reads the agent's state) fails the dump with an error
// naming it: net/http would recover the panic too, but it would close the
// connection without a word and, before, leave the dump's build slot held,
// so that every later dump waited for it until its caller gave up.
func marshalSection(section func() any) (b []byte, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return json.Marshal(section())
}

// levels are the names /logging and the LOG_LEVEL setting accept.
var levels = map[string]slog.Level{
	"debug": slog.LevelDebug,
	"info":  slog.LevelInfo,
	"warn":  slog.LevelWarn,
	"error": slog.LevelError,
}

// ParseLevel returns the level that name stands for: debug, info, warn or
// error, in any case. slog's own parser takes offsets too ("info+2", "debug-100"),
// which name no level the agent logs at and which /logging would refuse.
func ParseLevel(name string) (slog.Level, bool) {
	l, ok := levels[strings.ToLower(name)]
	return l, ok
}

// Levels beyond slog's four, so that /logging takes ztunnel's names:
// trace writes what debug does (the agent logs nothing finer), off writes
// nothing at all.
const (
	LevelTrace = slog.LevelDebug - 4
	LevelOff   = slog.Level(math.MaxInt32)
)

// loggingLevels are the names POST /logging takes, ztunnel's (src/admin.rs:
// error|warn|info|debug|trace|off), which istioctl ztunnel-config log sends
// (it turns warning into warn and critical into error).
var loggingLevels = map[string]slog.Level{
	"error": slog.LevelError, "warn": slog.LevelWarn, "info": slog.LevelInfo,
	"debug": slog.LevelDebug, "trace": LevelTrace, "off": LevelOff,
}

const wantLevels = "want error, warn, info, debug, trace or off"

// parseLogging reads a /logging level: a level, or a comma list of them
// of which the last wins (as in ztunnel's filter). A per-logger clause
// ("access=debug", or istioctl's "access:debug") is refused rather than
// ignored: the agent has one level for every logger.
func parseLogging(v string) (slog.Level, error) {
	var l slog.Level
	for _, clause := range strings.Split(v, ",") {
		if lv, ok := loggingLevels[strings.ToLower(clause)]; ok {
			l = lv
			continue
		}
		if strings.ContainsAny(clause, "=:") {
			return 0, fmt.Errorf("per-logger level %q: the agent has one level for every logger; %s", clip(clause), wantLevels)
		}
		return 0, fmt.Errorf("unknown level %q (%s)", clip(clause), wantLevels)
	}
	return l, nil
}

// clip cuts a caller's value to what an error message needs: a query may
// be as long as the header bound.
func clip(s string) string {
	const n = 64
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// levelName is l as /logging names it.
func levelName(l slog.Level) string {
	for name, lv := range loggingLevels {
		if lv == l {
			return name
		}
	}
	return strings.ToLower(l.String())
}

// showLevel answers GET /logging. A GET never changes anything (as in
// Envoy's admin API), so a crawler or a mistyped URL cannot turn debug
// logging on; one that tries is told to POST.
func showLevel(level *slog.LevelVar) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if name := r.URL.Query().Get("level"); name != "" {
			w.Header().Set("Allow", "GET, HEAD, POST")
			http.Error(w, fmt.Sprintf("use POST /logging?level=%s to change the level", clip(name)), http.StatusMethodNotAllowed)
			return
		}
		writeLevel(w, level)
	}
}

// setLevel answers POST /logging as ztunnel does, which is what istioctl
// ztunnel-config log expects: with no level (or an empty one, which is
// what istioctl sends to read it) it shows the level; with a level it sets
// it; with reset it goes back to the start-up level, then to the level if
// one is given too. A refused request leaves the level as it was.
func setLevel(level *slog.LevelVar, startup slog.Level, log *slog.Logger) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		name := q.Get("level")
		_, reset := q["reset"]
		if name == "" && !reset {
			writeLevel(w, level)
			return
		}
		l := startup
		if name != "" {
			var err error
			if l, err = parseLogging(name); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
		}
		if old := level.Level(); old != l {
			// At the higher of the two levels (error at most), so the
			// change is logged whichever way it went; before the change
			// when it turns logging off.
			at := min(max(old, l), slog.LevelError)
			if l == LevelOff {
				log.Log(r.Context(), at, "log level changed", "from", levelName(old), "to", levelName(l))
			}
			level.Set(l)
			if l != LevelOff {
				log.Log(r.Context(), at, "log level changed", "from", levelName(old), "to", levelName(l))
			}
		}
		writeLevel(w, level)
	}
}

func writeLevel(w http.ResponseWriter, level *slog.LevelVar) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "level=%s\n", levelName(level.Level()))
}
