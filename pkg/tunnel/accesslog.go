package tunnel

import (
	"context"
	"log/slog"
	"net/netip"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Access logs, shaped like ztunnel's (src/proxy/metrics.rs
// ConnectionResult): "connection opened" at debug when a connection is
// relayed, "connection complete" when it ends: at info, or at warn with
// the error when it failed or was refused. The fields are ztunnel's:
// src.addr, src.workload, src.namespace, src.identity, dst.addr,
// dst.hbone_addr, dst.service, dst.workload, dst.namespace, dst.identity,
// direction, bytes_sent, bytes_recv, duration; plus response_flags and the
// connection's trace id.
//
// A completed connection costs one line, written after the relay ended, off
// its path. Connections that never opened (denied, upstream unreachable)
// can come in floods a peer controls, so their lines are rate-limited per
// response flag like the refusal logs: the first of an interval in full,
// the rest summed up.
type accessLog struct {
	log *slog.Logger // nil: access logs off
	// refused rate-limits the lines of connections that never opened, by
	// response flag.
	refused map[string]*refusalLog
}

func newAccessLog(log *slog.Logger) *accessLog {
	if log == nil {
		return &accessLog{}
	}
	log = log.With("scope", "access")
	return &accessLog{log: log, refused: map[string]*refusalLog{
		flagDeny:    newRefusalLog(log, slog.LevelWarn),
		flagConnect: newRefusalLog(log, slog.LevelWarn),
	}}
}

// connResult is one counted connection: its resolved counters and what its
// access log lines need.
type connResult struct {
	m       *Metrics
	c       connInfo
	l       prometheus.Labels
	trace   string
	start   time.Time
	counted func(requestBytes, responseBytes int64)
}

// attrs are the access log fields of r, with bytes counted as the reporter
// sees them: ztunnel's metrics flip sent and received for the source
// reporter (istio/istio#32399), its logs do not.
func (r *connResult) attrs() []any {
	c, l := r.c, r.l
	mtls := l["connection_security_policy"] == "mutual_tls"
	srcName, dstName := l["source_canonical_service"], l["destination_canonical_service"]
	if c.src != nil {
		srcName = c.src.Name
	}
	if c.dst != nil {
		dstName = c.dst.Name
	}
	a := []any{"src.addr", addrOrEmpty(c.srcAddr), "src.workload", srcName, "src.namespace", l["source_workload_namespace"]}
	if mtls {
		a = append(a, "src.identity", l["source_principal"])
	}
	a = append(a, "dst.addr", addrOrEmpty(c.dstAddr))
	if c.hboneAddr.IsValid() {
		a = append(a, "dst.hbone_addr", c.hboneAddr.String())
	}
	a = append(a, "dst.service", l["destination_service"], "dst.workload", dstName, "dst.namespace", l["destination_workload_namespace"])
	if mtls {
		a = append(a, "dst.identity", l["destination_principal"])
	}
	dir := "inbound"
	if c.reporter == "source" {
		dir = "outbound"
	}
	a = append(a, "direction", dir)
	if r.trace != "" {
		a = append(a, "trace_id", r.trace)
	}
	return a
}

func addrOrEmpty(a netip.AddrPort) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}

// opened writes the debug line of a connection that is being relayed.
func (r *connResult) opened(ctx context.Context) {
	if log := r.m.access.log; log != nil && log.Enabled(ctx, slog.LevelDebug) {
		log.DebugContext(ctx, "connection opened", r.attrs()...)
	}
}

// close counts the connection closed with its bytes and writes its
// completion line; err is the relay's error, if any.
func (r *connResult) close(ctx context.Context, requestBytes, responseBytes int64, err error) {
	r.counted(requestBytes, responseBytes)
	log := r.m.access.log
	if log == nil {
		return
	}
	sent, recv := responseBytes, requestBytes
	if r.c.reporter == "source" {
		sent, recv = requestBytes, responseBytes
	}
	a := append(r.attrs(), "bytes_sent", sent, "bytes_recv", recv,
		"duration", strconv.FormatInt(time.Since(r.start).Milliseconds(), 10)+"ms")
	if f := r.l["response_flags"]; f != flagNone {
		a = append(a, "response_flags", f)
	}
	if err != nil {
		a = append(a, "error", err.Error())
	}
	switch {
	case r.c.flags != "" && r.m.access.refused[r.c.flags] != nil:
		r.m.access.refused[r.c.flags].note(ctx, "connection complete", a...)
	case err != nil:
		log.WarnContext(ctx, "connection complete", a...)
	default:
		log.InfoContext(ctx, "connection complete", a...)
	}
}
