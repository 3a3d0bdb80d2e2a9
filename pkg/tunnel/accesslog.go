package tunnel

import (
	"context"
	"io"
	"log/slog"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// Access logs, shaped like ztunnel's (src/proxy/metrics.rs
// ConnectionResult): "connection opened" at debug when a connection is
// relayed, "connection complete" when it ends: at info, or at warn with
// the error when it failed or was refused. The fields are ztunnel's:
// src.addr, src.workload, src.namespace, src.identity, dst.addr,
// dst.hbone_addr, dst.service, dst.workload, dst.namespace, dst.identity,
// direction, bytes_sent, bytes_recv, duration; plus response_flags, the
// connection's trace id, and dst.waypoint when dst is the waypoint the
// connection went through.
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
	// flow carries the relay's running counts into the byte counters
	// while the connection is open.
	flow byteFlow
}

// counts are the running counts the relay adds to (hbone.RelayCounting):
// AToB the request bytes, from the client.
func (r *connResult) counts() *hbone.Counts { return &r.flow.moved }

// attrs are the access log fields of r, typed (no boxing), with room for
// extra more.
func (r *connResult) attrs(extra int) []slog.Attr {
	c, l := r.c, r.l
	mtls := l["connection_security_policy"] == "mutual_tls"
	srcName, dstName := l["source_canonical_service"], l["destination_canonical_service"]
	if c.src != nil {
		srcName = c.src.Name
	}
	if c.dst != nil {
		dstName = c.dst.Name
	}
	a := make([]slog.Attr, 0, 15+extra)
	a = append(a, slog.String("src.addr", addrOrEmpty(c.srcAddr)), slog.String("src.workload", srcName),
		slog.String("src.namespace", l["source_workload_namespace"]))
	if mtls {
		a = append(a, slog.String("src.identity", l["source_principal"]))
	}
	a = append(a, slog.String("dst.addr", addrOrEmpty(c.dstAddr)))
	if c.hboneAddr.IsValid() {
		a = append(a, slog.String("dst.hbone_addr", c.hboneAddr.String()))
	}
	a = append(a, slog.String("dst.service", l["destination_service"]), slog.String("dst.workload", dstName),
		slog.String("dst.namespace", l["destination_workload_namespace"]))
	if mtls {
		a = append(a, slog.String("dst.identity", l["destination_principal"]))
	}
	if c.waypoint {
		a = append(a, slog.Bool("dst.waypoint", true))
	}
	dir := "inbound"
	if c.reporter == "source" {
		dir = "outbound"
	}
	a = append(a, slog.String("direction", dir))
	if r.trace != "" {
		a = append(a, slog.String("trace_id", r.trace))
	}
	return a
}

// maxLoggedError bounds the text of an error in a log line. Errors can
// carry what a peer sent (a GOAWAY's debug data, up to a frame; a refusal
// reason), and one peer frame can end many connections, each logged: the
// start of the text says what happened, the rest would only let a peer
// write megabytes into the node's logs.
const maxLoggedError = 512

// errText is err's text, cut to maxLoggedError bytes on a character
// boundary, with invalid UTF-8 replaced, saying how much was cut.
func errText(err error) string {
	s := err.Error()
	if len(s) <= maxLoggedError {
		return strings.ToValidUTF8(s, "\uFFFD")
	}
	cut := maxLoggedError
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return strings.ToValidUTF8(s[:cut], "\uFFFD") + " [" + strconv.Itoa(len(s)-cut) + " bytes cut]"
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
		log.LogAttrs(ctx, slog.LevelDebug, "connection opened", r.attrs(0)...)
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
	a := append(r.attrs(5), slog.Int64("bytes_sent", sent), slog.Int64("bytes_recv", recv),
		slog.String("duration", strconv.FormatInt(time.Since(r.start).Milliseconds(), 10)+"ms"))
	if f := r.l["response_flags"]; f != flagNone {
		a = append(a, slog.String("response_flags", f))
	}
	if err != nil {
		a = append(a, slog.String("error", errText(err)))
	}
	switch {
	case r.c.flags != "" && r.m.access.refused[r.c.flags] != nil:
		args := make([]any, len(a))
		for i := range a {
			args[i] = a[i]
		}
		r.m.access.refused[r.c.flags].note(ctx, "connection complete", args...)
	case err != nil:
		log.LogAttrs(ctx, slog.LevelWarn, "connection complete", a...)
	default:
		log.LogAttrs(ctx, slog.LevelInfo, "connection complete", a...)
	}
}

// accessLogFlushEvery bounds how long an access log line waits in an
// AccessLogWriter's buffer.
const accessLogFlushEvery = 100 * time.Millisecond

// accessLogBuffer is how much an AccessLogWriter gathers before it writes.
const accessLogBuffer = 64 << 10

// AccessLogWriter batches access log lines into few writes: one write(2)
// per line and connection would cost the data path a system call on every
// close (and the reader of the log pipe a wake-up), several percent of the
// new-connection rate. Lines wait at most accessLogFlushEvery; each Write
// must be whole lines, as slog handlers write one record per call. The flush
// timer runs only while lines wait, so an idle agent is not woken ten times
// a second for nothing.
type AccessLogWriter struct {
	mu  sync.Mutex
	w   io.Writer
	buf []byte
	// waiting gets a token when the buffer turns non-empty.
	waiting chan struct{}
	stop    chan struct{}
	done    chan struct{}
}

// NewAccessLogWriter starts a writer that flushes to w; Close flushes and
// stops it.
func NewAccessLogWriter(w io.Writer) *AccessLogWriter {
	a := &AccessLogWriter{w: w, buf: make([]byte, 0, accessLogBuffer), waiting: make(chan struct{}, 1),
		stop: make(chan struct{}), done: make(chan struct{})}
	go a.loop()
	return a
}

func (a *AccessLogWriter) loop() {
	defer close(a.done)
	t := time.NewTimer(accessLogFlushEvery)
	t.Stop()
	for {
		select {
		case <-a.waiting:
			t.Reset(accessLogFlushEvery)
		case <-t.C:
			a.Flush()
		case <-a.stop:
			t.Stop()
			a.Flush()
			return
		}
	}
}

// Write buffers p, writing the buffer first when p would not fit.
func (a *AccessLogWriter) Write(p []byte) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.buf)+len(p) > cap(a.buf) {
		if err := a.flushLocked(); err != nil {
			return 0, err
		}
		if len(p) > cap(a.buf) {
			return a.w.Write(p)
		}
	}
	if len(a.buf) == 0 && len(p) > 0 {
		select {
		case a.waiting <- struct{}{}:
		default: // a flush is due already
		}
	}
	a.buf = append(a.buf, p...)
	return len(p), nil
}

// Flush writes what is buffered.
func (a *AccessLogWriter) Flush() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.flushLocked()
}

func (a *AccessLogWriter) flushLocked() error {
	if len(a.buf) == 0 {
		return nil
	}
	_, err := a.w.Write(a.buf)
	a.buf = a.buf[:0]
	return err
}

// Close flushes and stops the writer.
func (a *AccessLogWriter) Close() error {
	close(a.stop)
	<-a.done
	return nil
}
