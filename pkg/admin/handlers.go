package admin

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metricsHandler serves reg. A collector that fails (a BPF map that cannot
// be read) is logged and counted in promhttp_metric_handler_errors_total
// while the other metrics are still served, so one broken source does not
// blind every dashboard.
//
// A scrape reads every BPF map and series, so scrapes beyond
// maxScrapesInFlight at once are answered 503 rather than queued: anyone
// who reaches the port (every pod can) could otherwise make the agent spend
// its CPU gathering metrics.
func metricsHandler(reg *prometheus.Registry, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:            slog.NewLogLogger(log.Handler(), slog.LevelError),
		ErrorHandling:       promhttp.ContinueOnError,
		Registry:            reg,
		MaxRequestsInFlight: maxScrapesInFlight,
	}))
	return mux
}

// maxScrapesInFlight is how many scrapes are gathered at once: an HA pair
// of Prometheus servers and a person with curl.
const maxScrapesInFlight = 4

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
	"GET  /debug/pprof/            Go profiles (net/http/pprof)",
	"GET  /logging                 the current log level",
	"POST /logging?level=LEVEL     set the log level: debug, info, warn or error",
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
	mux.HandleFunc("GET /config_dump", configDump(sections))
	mux.HandleFunc("GET /debug/pprof/", pprof.Index)
	mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("POST /debug/pprof/symbol", pprof.Symbol) // the pprof tool posts its lookups
	mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	mux.HandleFunc("GET /logging", showLevel(level))
	mux.HandleFunc("POST /logging", setLevel(level, log))
	return mux
}

// configDumpWrite bounds how long a reader may take to read a dump: each
// one holds its copy until it is written.
const configDumpWrite = time.Minute

// configDump writes every section as one JSON object. Each section is
// marshalled on its own so that a failure names the section at fault.
//
// A dump of a large directory takes memory and CPU in proportion, so one
// is built at a time (other callers wait their turn or give up), and a
// caller that reads it slowly is cut off after configDumpWrite rather than
// holding its copy for ever.
func configDump(sections map[string]func() any) http.HandlerFunc {
	building := make(chan struct{}, 1)
	return func(w http.ResponseWriter, r *http.Request) {
		select {
		case building <- struct{}{}:
		case <-r.Context().Done():
			return
		}
		out, name, err := buildDump(sections)
		<-building
		if err != nil {
			http.Error(w, fmt.Sprintf("config dump section %s: %v", name, err), http.StatusInternalServerError)
			return
		}
		_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(configDumpWrite))
		w.Header().Set("Content-Type", "application/json")
		w.Write(out) // the client is gone if this fails
	}
}

// buildDump marshals every section, indented, or names the one that fails.
func buildDump(sections map[string]func() any) (out []byte, failed string, err error) {
	dump := make(map[string]json.RawMessage, len(sections))
	for name, section := range sections {
		b, err := json.Marshal(section())
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

// levels are the names /logging accepts, as the --log-level flag does.
var levels = map[string]slog.Level{
	"debug": slog.LevelDebug,
	"info":  slog.LevelInfo,
	"warn":  slog.LevelWarn,
	"error": slog.LevelError,
}

// showLevel answers GET /logging. A GET never changes anything (as in
// Envoy's admin API), so a crawler or a mistyped URL cannot turn debug
// logging on; one that tries is told to POST.
func showLevel(level *slog.LevelVar) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if name := r.URL.Query().Get("level"); name != "" {
			w.Header().Set("Allow", "GET, HEAD, POST")
			http.Error(w, fmt.Sprintf("use POST /logging?level=%s to change the level", name), http.StatusMethodNotAllowed)
			return
		}
		writeLevel(w, level)
	}
}

// setLevel answers POST /logging?level=debug|info|warn|error.
func setLevel(level *slog.LevelVar, log *slog.Logger) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		name := r.URL.Query().Get("level")
		if name == "" {
			http.Error(w, "missing level parameter (want debug, info, warn or error)", http.StatusBadRequest)
			return
		}
		l, ok := levels[strings.ToLower(name)]
		if !ok {
			http.Error(w, fmt.Sprintf("unknown level %q (want debug, info, warn or error)", name), http.StatusBadRequest)
			return
		}
		if old := level.Level(); old != l {
			level.Set(l)
			// At the higher of the two levels, so the change is logged
			// whichever way it went.
			log.Log(r.Context(), max(old, l), "log level changed", "from", old, "to", l)
		}
		writeLevel(w, level)
	}
}

func writeLevel(w http.ResponseWriter, level *slog.LevelVar) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "level=%s\n", strings.ToLower(level.Level().String()))
}
