package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// rawTLSClient is a client that never drains for the server's certificate
// (as curl or another mesh's proxy need not): raw HTTP/2 frames over TLS
// to addr, verifying nothing of the server, presenting cert.
func rawTLSClient(t *testing.T, addr string, cert tls.Certificate) (*rawClient, error) {
	t.Helper()
	tc, err := tls.Dial("tcp", addr, &tls.Config{MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"},
		Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true})
	if err != nil {
		return nil, err
	}
	return newRawClientOver(t, tc), nil
}

// openedRawStream connects a rawTLSClient to addr, presenting cert, and
// opens stream 1 to app on it.
func openedRawStream(t *testing.T, addr string, cert tls.Certificate, app string) *rawClient {
	t.Helper()
	rc, err := rawTLSClient(t, addr, cert)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.connect(1, app); err != nil {
		t.Fatal(err)
	}
	rc.wantOpened(1)
	return rc
}

// wantOpened waits for the 200 of stream id.
func (rc *rawClient) wantOpened(id uint32) {
	rc.t.Helper()
	f := rc.waitFor("the response", func(f rawFrame) bool {
		return f.stream == id && (f.typ == http2.FrameHeaders || f.typ == http2.FrameRSTStream)
	})
	if f.typ != http2.FrameHeaders || f.status != 200 {
		rc.t.Fatalf("stream %d: %+v, want 200", id, f)
	}
}

// wantRefusedAndDrained checks that stream id was refused with
// REFUSED_STREAM under a GOAWAY whose last stream is last, so the client
// retries it on a new connection.
func (rc *rawClient) wantRefusedAndDrained(id, last uint32) {
	rc.t.Helper()
	var refused, drained bool
	for !refused || !drained {
		f := rc.waitFor("REFUSED_STREAM and GOAWAY", func(f rawFrame) bool {
			return f.typ == http2.FrameGoAway || f.stream == id
		})
		switch {
		case f.typ == http2.FrameGoAway:
			if f.last != last {
				rc.t.Fatalf("GOAWAY names stream %d as the last, want %d", f.last, last)
			}
			drained = true
		case f.typ == http2.FrameRSTStream && f.code == http2.ErrCodeRefusedStream:
			refused = true
		default:
			rc.t.Fatalf("stream %d, opened after the server's certificate stopped being current: %+v, want REFUSED_STREAM", id, f)
		}
	}
}

// wantRawEcho checks that stream id, open to an echo app, still carries
// data both ways.
func (rc *rawClient) wantRawEcho(id uint32) {
	rc.t.Helper()
	msg := []byte("still here")
	if err := rc.fr.WriteData(id, false, msg); err != nil {
		rc.t.Fatal(err)
	}
	got := 0
	for got < len(msg) {
		f := rc.waitFor("the echo", func(f rawFrame) bool {
			return f.stream == id && (f.typ == http2.FrameData || f.typ == http2.FrameRSTStream)
		})
		if f.typ != http2.FrameData {
			rc.t.Fatalf("stream %d open before the drain: %+v, want the echo", id, f)
		}
		got += int(f.length)
	}
}

// Our server presents a certificate in each connection's handshake and
// then carries new streams on that connection for as long as the client
// keeps it. A client that does not drain at our chain's end would go on
// opening streams to our pod, as its peer, after our certificate ended:
// the server refuses the first new stream after the end (REFUSED_STREAM,
// GOAWAY naming the stream open before as the last), so the client
// retries it on a new connection; the stream open before runs on. With a
// callback (the identity manager's, through GetConfigForClient as the
// tunnel's pod servers have it) the new connection presents the renewed
// certificate; with only the ended one (static) the new handshake fails
// rather than present it, though this client's clock would take it.
func TestServerNoStreamsAfterOwnCertificateExpired(t *testing.T) {
	for _, mode := range []string{"renewed", "static", "static intermediate"} {
		t.Run(mode, func(t *testing.T) {
			pki := newExpiringPKI(t, 2*time.Second)
			short, end := pki.endingFor(mode)
			conf := pki.config(short, true)
			if mode == "renewed" {
				conf = &tls.Config{MinVersion: tls.VersionTLS13, GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
					c := pki.config(short, true)
					c.Certificates = nil
					c.GetCertificate = func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
						if time.Now().Before(end) {
							return &short, nil
						}
						return &pki.lasting, nil
					}
					return c, nil
				}}
			}
			srv, addr := serveLoopback(t, ServerOptions{TLSConfig: conf, Handler: dialTarget})
			app := startUpstream(t, echo).String()
			rc := openedRawStream(t, addr, pki.lasting, app)
			waitfor.Until(t, "the presented chain's end", func() bool { return !time.Now().Before(end) })

			if err := rc.connect(3, app); err != nil {
				t.Fatal(err)
			}
			rc.wantRefusedAndDrained(3, 1)
			rc.wantRawEcho(1)
			if st := srv.Stats(); st.OwnCertificateDrains != 1 || st.StreamsOK != 1 {
				t.Errorf("OwnCertificateDrains = %d, StreamsOK = %d, want 1 and 1", st.OwnCertificateDrains, st.StreamsOK)
			}

			retry, err := rawTLSClient(t, addr, pki.lasting)
			if mode != "renewed" {
				if err == nil {
					t.Fatal("a new handshake after the server's chain ended succeeded: it presented the ended certificate")
				}
				t.Logf("new handshake: %v", err)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := retry.connect(1, app); err != nil {
				t.Fatal(err)
			}
			retry.wantOpened(1)
		})
	}
}

// A server certificate whose chain has already ended is not presented:
// the handshake fails on our side, even to a client whose clock would
// take it.
func TestServerOwnCertificateEndedNotPresented(t *testing.T) {
	pki := newExpiringPKI(t, -time.Minute)
	conf := pki.config(pki.expiring, true)
	srv, addr := serveLoopback(t, ServerOptions{TLSConfig: conf, Handler: dialTarget})
	if _, err := rawTLSClient(t, addr, pki.lasting); err == nil {
		t.Fatal("the handshake presented a certificate whose chain had ended")
	}
	waitfor.Until(t, "the handshake failure counted", func() bool { return srv.Stats().HandshakeFailures == 1 })
	var got *presentedCert
	_, err := serving(conf, &got).GetCertificate(&tls.ClientHelloInfo{})
	if err == nil || !strings.Contains(err.Error(), "server certificate's chain ended at") {
		t.Errorf("GetCertificate: %v, want an error naming the chain's end", err)
	}
}

// The certificate a connection presented no longer being the one a new
// handshake would present (renewed; replaced because its root is being
// removed), or a trust change refusing it, stops new streams on the
// connection, which the client retries on a new one; the stream open
// meanwhile runs on.
//   - renewed: the server's callback gives another certificate; the next
//     new stream after ownCertRecheck is refused.
//   - trust change: DrainPresented (the node's trust change) drains the
//     connections whose presented certificate it refuses, and only them.
//   - trust change during the handshake: a connection whose certificate
//     was fetched before the change and registered after DrainPresented
//     went through the server's connections is drained once registered.
func TestServerNoStreamsAsReplacedOwnCertificate(t *testing.T) {
	defer func(d time.Duration) { ownCertRecheck = d }(ownCertRecheck)
	ownCertRecheck = 50 * time.Millisecond
	good, other := pkis()
	for _, mode := range []string{"renewed", "trust change", "trust change during the handshake"} {
		t.Run(mode, func(t *testing.T) {
			var cur atomic.Pointer[tls.Certificate]
			cur.Store(&good.leaf)
			refuseOld := func(c *tls.Certificate) bool { return !bytes.Equal(c.Certificate[0], good.leaf.Certificate[0]) }
			var srv *Server
			var changeInHandshake atomic.Bool
			changeInHandshake.Store(mode == "trust change during the handshake")
			conf := good.serverTLS()
			conf.Certificates = nil
			conf.GetCertificate = func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
				if changeInHandshake.CompareAndSwap(true, false) {
					if n := srv.DrainPresented(refuseOld); n != 0 {
						t.Errorf("DrainPresented before any connection was registered drained %d", n)
					}
				}
				return cur.Load(), nil
			}
			srv, addr := serveLoopback(t, ServerOptions{TLSConfig: conf, Handler: dialTarget})
			app := startUpstream(t, echo).String()
			if mode == "trust change during the handshake" {
				wantDrainedAtStart(t, addr, good.leaf, app)
				if st := srv.Stats(); st.OwnCertificateDrains != 1 || st.StreamsOK != 0 {
					t.Errorf("OwnCertificateDrains = %d, StreamsOK = %d, want 1 and 0", st.OwnCertificateDrains, st.StreamsOK)
				}
				return
			}
			rc := openedRawStream(t, addr, good.leaf, app)
			switch mode {
			case "renewed":
				cur.Store(&other.leaf)
				time.Sleep(2 * ownCertRecheck)
			case "trust change":
				if n := srv.DrainPresented(func(*tls.Certificate) bool { return true }); n != 0 {
					t.Fatalf("DrainPresented keeping all drained %d", n)
				}
				if n := srv.DrainPresented(refuseOld); n != 1 {
					t.Fatalf("DrainPresented refusing the presented certificate drained %d, want 1", n)
				}
			}
			if err := rc.connect(3, app); err != nil {
				t.Fatal(err)
			}
			rc.wantRefusedAndDrained(3, 1)
			rc.wantRawEcho(1)
			if st := srv.Stats(); st.OwnCertificateDrains != 1 || st.StreamsOK != 1 {
				t.Errorf("OwnCertificateDrains = %d, StreamsOK = %d, want 1 and 1", st.OwnCertificateDrains, st.StreamsOK)
			}
		})
	}
}

// wantDrainedAtStart opens a connection to addr and a stream on it, and
// checks that the server drained the connection before taking the stream.
// The server may close the connection while the client still writes its
// preface, so write errors are not failures here.
func wantDrainedAtStart(t *testing.T, addr string, cert tls.Certificate, app string) {
	t.Helper()
	tc, err := tls.Dial("tcp", addr, &tls.Config{MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"},
		Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true})
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	var out, hdr bytes.Buffer
	out.WriteString(http2.ClientPreface)
	fr := http2.NewFramer(&out, nil)
	_ = fr.WriteSettings()
	enc := hpack.NewEncoder(&hdr)
	_ = enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
	_ = enc.WriteField(hpack.HeaderField{Name: ":authority", Value: app})
	_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hdr.Bytes(), EndHeaders: true})
	_, _ = tc.Write(out.Bytes())
	_ = tc.SetReadDeadline(time.Now().Add(5 * time.Second))
	in := http2.NewFramer(nil, tc)
	in.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	goAway := false
	for {
		f, err := in.ReadFrame()
		if err != nil {
			break
		}
		switch f := f.(type) {
		case *http2.GoAwayFrame:
			if f.LastStreamID != 0 {
				t.Errorf("GOAWAY names stream %d as the last, want 0", f.LastStreamID)
			}
			goAway = true
		case *http2.MetaHeadersFrame:
			t.Fatalf("stream %d answered %s on a connection whose certificate a trust change refused", f.StreamID, f.PseudoValue("status"))
		}
	}
	if !goAway {
		t.Error("no GOAWAY before the connection ended")
	}
}

// The certificate a connection presented is compared with the current one
// by leaf, not by pointer: a callback that builds a new tls.Certificate
// for the same certificate at each call must not drain every connection.
func TestServerSameOwnCertificateKeepsConnection(t *testing.T) {
	defer func(d time.Duration) { ownCertRecheck = d }(ownCertRecheck)
	ownCertRecheck = time.Millisecond
	good, _ := pkis()
	conf := good.serverTLS()
	conf.Certificates = nil
	conf.GetCertificate = func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
		c := good.leaf
		c.Certificate = [][]byte{bytes.Clone(good.leaf.Certificate[0])}
		return &c, nil
	}
	srv, addr := serveLoopback(t, ServerOptions{TLSConfig: conf, Handler: dialTarget})
	app := startUpstream(t, echo).String()
	rc, err := rawTLSClient(t, addr, good.leaf)
	if err != nil {
		t.Fatal(err)
	}
	for id := uint32(1); id <= 5; id += 2 {
		time.Sleep(5 * time.Millisecond)
		if err := rc.connect(id, app); err != nil {
			t.Fatal(err)
		}
		rc.wantOpened(id)
	}
	// A tunnel is counted once its 200 is written: the client may read the
	// last one before the count (seen under -race on a loaded machine).
	waitfor.Until(t, "three tunnels counted", func() bool { return srv.Stats().StreamsOK >= 3 })
	if st := srv.Stats(); st.OwnCertificateDrains != 0 || st.StreamsOK != 3 {
		t.Errorf("OwnCertificateDrains = %d, StreamsOK = %d, want 0 and 3", st.OwnCertificateDrains, st.StreamsOK)
	}
}

// servedNow asks a config as the tunnel's pod servers have it (through
// GetConfigForClient) what a handshake would present; a static config
// with several certificates chooses by the client's hello: unknown.
func TestServedNow(t *testing.T) {
	good, other := pkis()
	nc, peer := net.Pipe()
	defer nc.Close()
	defer peer.Close()
	viaCallback := &tls.Config{GetConfigForClient: func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
		if hello.Conn != nc {
			t.Errorf("hello.Conn = %v, want the connection", hello.Conn)
		}
		return good.serverTLS(), nil
	}}
	if cert, known := servedNow(viaCallback, nc); !known || !sameLeaf(cert, &good.leaf) {
		t.Errorf("through GetConfigForClient: %v %v, want the leaf", cert != nil, known)
	}
	several := good.serverTLS()
	several.Certificates = append(several.Certificates, other.leaf)
	if _, known := servedNow(several, nc); known {
		t.Error("several static certificates: known, want unknown")
	}
	failing := &tls.Config{GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return nil, net.ErrClosed }}
	if cert, known := servedNow(failing, nc); !known || cert != nil {
		t.Errorf("a failing callback: %v %v, want none, known", cert != nil, known)
	}
}

// Our pool against our server across the server's renewals: the first
// Connect after each finds its pooled connection refusing new streams
// (REFUSED_STREAM under a GOAWAY, or the GOAWAY and close of an idle
// connection) and retries on a new one, presenting the renewed
// certificate: no CONNECT fails for the server's renewal, and the stream
// open across it runs on.
func TestPoolRetriesAcrossServerRenewal(t *testing.T) {
	defer func(d time.Duration) { ownCertRecheck = d }(ownCertRecheck)
	ownCertRecheck = 10 * time.Millisecond
	good, other := pkis()
	var cur atomic.Pointer[tls.Certificate]
	cur.Store(&good.leaf)
	conf := good.serverTLS()
	conf.Certificates = nil
	conf.GetCertificate = func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return cur.Load(), nil }
	e := newEnv(t, dialTarget, ServerOptions{TLSConfig: conf}, PoolOptions{})
	app := startUpstream(t, echo)
	client := good.clientTLS()
	client.InsecureSkipVerify = true // other's root: verifying is not what this tests
	connect := func() *Stream {
		t.Helper()
		s, err := e.pool.Connect(context.Background(), e.key, tcpDial, client, Request{Authority: app, Forwarded: `for="10.0.0.1"`})
		if err != nil {
			t.Fatalf("connect after the server's renewal: %v", err)
		}
		return s
	}
	open := connect()
	defer open.Close()
	cur.Store(&other.leaf) // busy: a stream is open on the connection
	time.Sleep(2 * ownCertRecheck)
	connect().Close()
	wantEcho(t, open)
	open.Close()
	waitfor.Until(t, "no stream open", func() bool { return e.pool.Stats().ActiveStreams == 0 })
	cur.Store(&good.leaf) // idle: no stream open on the connection
	time.Sleep(2 * ownCertRecheck)
	connect().Close()
	if st := e.srv.Stats(); st.OwnCertificateDrains != 2 {
		t.Errorf("OwnCertificateDrains = %d, want 2", st.OwnCertificateDrains)
	}
	if st := e.pool.Stats(); st.DialsTotal != 3 {
		t.Errorf("dials = %d, want 3: one per certificate the server presented", st.DialsTotal)
	}
}
