package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

type hpackField = hpack.HeaderField

// rawOutcome is how the server answered stream 1.
type rawOutcome struct {
	status int           // response :status, 0 if none
	reset  http2.ErrCode // RST_STREAM code, if reset
	goAway bool          // the connection was closed with GOAWAY
}

// rawExchange serves one plaintext HTTP/2 connection over net.Pipe, sends
// the given frames after the preface and our SETTINGS, and reports how the
// server answered stream 1.
func rawExchange(t testing.TB, srv *Server, send func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer) error) rawOutcome {
	t.Helper()
	cli, srvSide := net.Pipe()
	defer cli.Close()
	go srv.serveHTTP2(srvSide, &tls.ConnectionState{}, nil, nil, trustGens{}, nil)
	_ = cli.SetDeadline(time.Now().Add(5 * time.Second))

	sent := make(chan error, 1)
	go func() {
		var buf bytes.Buffer
		fr := http2.NewFramer(cli, nil)
		if _, err := cli.Write([]byte(http2.ClientPreface)); err != nil {
			sent <- err
			return
		}
		if err := fr.WriteSettings(); err != nil {
			sent <- err
			return
		}
		sent <- send(fr, hpack.NewEncoder(&buf), &buf)
	}()

	fr := http2.NewFramer(nil, cli)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("server neither answered nor sent GOAWAY: %v", err)
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			if f.StreamID == 1 {
				status, _ := strconv.Atoi(f.PseudoValue("status"))
				cli.Close()
				<-sent
				return rawOutcome{status: status}
			}
		case *http2.RSTStreamFrame:
			if f.StreamID == 1 {
				cli.Close()
				<-sent
				return rawOutcome{reset: f.ErrCode}
			}
		case *http2.GoAwayFrame:
			cli.Close()
			<-sent
			return rawOutcome{goAway: true}
		}
	}
}

func writeHeaderBlock(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer, id uint32, fields []hpackField) error {
	buf.Reset()
	for _, f := range fields {
		if err := enc.WriteField(f); err != nil {
			return err
		}
	}
	return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: buf.Bytes(), EndHeaders: true})
}

func newFuzzServer(t testing.TB) *Server {
	good, _ := pkis()
	srv, err := NewServer(ServerOptions{
		TLSConfig: good.serverTLS(),
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			return Response{Status: 403, Reason: "fuzz"} // every valid request reaches us
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	return srv
}

// FuzzServerRequest sends arbitrary :method, :authority and one extra header
// to a real server connection. The server must never panic, must answer a
// valid CONNECT by asking the handler (403 here), and must refuse anything
// else with a 4xx or a stream/connection error.
func FuzzServerRequest(f *testing.F) {
	f.Add("CONNECT", "10.0.0.1:80", "forwarded", `for="10.0.0.2"`)
	f.Add("CONNECT", "[fd00::1]:15008", "baggage", "k=v")
	f.Add("GET", "10.0.0.1:80", "", "")
	f.Add("CONNECT", "", "", "")
	f.Add("CONNECT", "svc.ns:80", "", "")
	f.Add("CONNECT", "10.0.0.1", "", "")
	f.Add("CONNECT", "10.0.0.1:80", ":path", "/")
	f.Add("CONNECT", "10.0.0.1:80", ":protocol", "websocket")
	f.Add("CONNECT", "10.0.0.1:80", "Upper", "x")
	f.Add("CONNECT", "10.0.0.1:80", "connection", "close")
	f.Add("CONNECT", "10.0.0.1:80", "x", "bad\r\nvalue")
	f.Add("CONNECT", "[fe80::1%eth0]:80", "", "")
	f.Add("connect", "10.0.0.1:80", "", "")
	srv := newFuzzServer(f)
	f.Fuzz(func(t *testing.T, method, authority, name, value string) {
		if len(method)+len(authority)+len(name)+len(value) > 4096 {
			t.Skip("header list limits are tested separately")
		}
		fields := []hpackField{{Name: ":method", Value: method}}
		if authority != "" {
			fields = append(fields, hpackField{Name: ":authority", Value: authority})
		}
		if name != "" {
			fields = append(fields, hpackField{Name: name, Value: value})
		}
		out := rawExchange(t, srv, func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer) error {
			return writeHeaderBlock(fr, enc, buf, 1, fields)
		})
		valid := wantValid(method, authority, name, value)
		switch {
		case valid && out.status != 403:
			t.Fatalf("valid request answered %+v, want the handler's 403", out)
		case !valid && out.status == 403:
			t.Fatalf("invalid request reached the handler")
		case out.status != 0 && (out.status < 400 || out.status > 499):
			t.Fatalf("status %d, want 4xx", out.status)
		}
	})
}

// wantValid is an independent statement of what the server must accept.
func wantValid(method, authority, name, value string) bool {
	if method != "CONNECT" {
		return false
	}
	ap, err := netip.ParseAddrPort(authority)
	if err != nil || ap.Port() == 0 || ap.Addr().Zone() != "" || !httpguts.ValidHeaderFieldValue(authority) {
		return false
	}
	if name == "" {
		return true
	}
	if strings.HasPrefix(name, ":") || name != strings.ToLower(name) ||
		!httpguts.ValidHeaderFieldName(name) || !httpguts.ValidHeaderFieldValue(value) {
		return false
	}
	switch name {
	case "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade":
		return false
	case "te":
		return value == "trailers"
	}
	return true
}

func TestOversizedHeaders(t *testing.T) {
	checkGoroutines(t)
	srv := newFuzzServer(t)
	out := rawExchange(t, srv, func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer) error {
		return writeHeaderBlock(fr, enc, buf, 1, []hpackField{
			{Name: ":method", Value: "CONNECT"},
			{Name: ":authority", Value: "10.0.0.1:80"},
			{Name: "x-big", Value: strings.Repeat("a", 8<<10)},
			{Name: "x-big2", Value: strings.Repeat("b", 8<<10)},
		})
	})
	if out.status != 431 && !out.goAway {
		t.Fatalf("oversized headers: %+v, want 431 or GOAWAY", out)
	}
}

func TestDataOnIdleStreamIsConnectionError(t *testing.T) {
	checkGoroutines(t)
	srv := newFuzzServer(t)
	out := rawExchange(t, srv, func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer) error {
		return fr.WriteData(1, false, []byte("x"))
	})
	if !out.goAway {
		t.Fatalf("DATA on an idle stream: %+v, want GOAWAY", out)
	}
}

func TestFlowControlViolation(t *testing.T) {
	checkGoroutines(t)
	srv := newFuzzServer(t)
	srv.opts.Handler = func(ctx context.Context, req *ServerRequest) Response {
		// Hold the stream open, reading nothing, until its reset (a
		// sleep here lost the race against a slow writer under -race).
		<-ctx.Done()
		return Response{Status: 403}
	}
	out := rawExchange(t, srv, func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer) error {
		err := writeHeaderBlock(fr, enc, buf, 1, []hpackField{{Name: ":method", Value: "CONNECT"}, {Name: ":authority", Value: "10.0.0.1:80"}})
		// streamWindow+1 bytes: one more than the server granted.
		chunk := make([]byte, 1<<14)
		for sent := 0; err == nil && sent <= streamWindow; sent += len(chunk) {
			if streamWindow+1-sent < len(chunk) {
				chunk = chunk[:streamWindow+1-sent]
			}
			err = fr.WriteData(1, false, chunk)
		}
		if errors.Is(err, io.ErrClosedPipe) {
			return nil // the server hung up on us: fine
		}
		return err
	})
	if out.reset != http2.ErrCodeFlowControl && !out.goAway {
		t.Fatalf("window overrun: %+v, want RST_STREAM(FLOW_CONTROL_ERROR)", out)
	}
}

// recordConn is an upstream that keeps what it is sent and reports it at
// the stream's end.
type recordConn struct {
	sinkConn
	mu   sync.Mutex
	data []byte
	got  chan []byte
}

func (c *recordConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.data = append(c.data, p...)
	c.mu.Unlock()
	return len(p), nil
}

func (c *recordConn) CloseWrite() error {
	c.mu.Lock()
	c.got <- c.data
	c.mu.Unlock()
	return c.sinkConn.CloseWrite()
}

// TestPaddedAndLargeDataFrames sends DATA frames our client never sends
// (padded, and larger than a receive chunk) and checks the bytes arrive.
func TestPaddedAndLargeDataFrames(t *testing.T) {
	checkGoroutines(t)
	up := &recordConn{sinkConn: *newSinkConn(), got: make(chan []byte, 1)}
	srv := newFuzzServer(t)
	srv.opts.Handler = func(ctx context.Context, req *ServerRequest) Response { return Response{Upstream: up} }

	large := make([]byte, 3*chunkSize+123)
	_, _ = newPRNGReader(7).Read(large)
	want := append(append([]byte("hello"), large...), "end"...)

	fr, _ := rawStream(t, srv, "10.0.0.1:80", 5*time.Second)
	if err := fr.WriteDataPadded(1, false, []byte("hello"), make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteDataPadded(1, false, large, make([]byte, 255)); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteData(1, true, []byte("end")); err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-up.got:
		if !bytes.Equal(got, want) {
			t.Fatalf("upstream got %d bytes, want %d (or different bytes)", len(got), len(want))
		}
	case <-time.After(5 * time.Second):
		t.Fatal("upstream never saw the end of the stream")
	}
}

// rawStream opens stream 1 on srv from a raw HTTP/2 client over a pipe, with a CONNECT to
// authority sent once the server's SETTINGS arrived. It returns the client's framer and a
// channel closed when the server answers; the server's frames are otherwise dropped.
func rawStream(t *testing.T, srv *Server, authority string, timeout time.Duration) (*http2.Framer, <-chan struct{}) {
	t.Helper()
	cli, srvSide := net.Pipe()
	t.Cleanup(func() { cli.Close() })
	go srv.serveHTTP2(srvSide, &tls.ConnectionState{}, nil, nil, trustGens{}, nil)
	_ = cli.SetDeadline(time.Now().Add(timeout))
	settings, answered := make(chan struct{}), make(chan struct{})
	go func() {
		fr := http2.NewFramer(nil, cli)
		var s, a sync.Once
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if !f.IsAck() {
					s.Do(func() { close(settings) })
				}
			case *http2.HeadersFrame:
				a.Do(func() { close(answered) })
			}
		}
	}()
	fr := http2.NewFramer(cli, nil)
	var buf bytes.Buffer
	_, _ = cli.Write([]byte(http2.ClientPreface))
	_ = fr.WriteSettings()
	<-settings
	if err := writeHeaderBlock(fr, hpack.NewEncoder(&buf), &buf, 1, []hpackField{{Name: ":method", Value: "CONNECT"}, {Name: ":authority", Value: authority}}); err != nil {
		t.Fatal(err)
	}
	return fr, answered
}
