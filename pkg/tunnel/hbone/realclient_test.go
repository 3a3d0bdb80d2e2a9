package hbone

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
)

// realClient returns the path of a third-party client the test needs. A
// client missing is a failure, not a skip: `make deps` installs it.
func realClient(t testing.TB, name, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s not found (make deps; apt-get install %s): %v", name, pkg, err)
	}
	return p
}

// pemFiles writes p's leaf, its key and its CA to files for a client.
func (p *testPKI) pemFiles(t testing.TB) (cert, key string) {
	t.Helper()
	dir := t.TempDir()
	cert, key = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	keyDER, err := x509.MarshalPKCS8PrivateKey(p.leaf.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: p.leaf.Certificate[0]}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return cert, key
}

// sClient is an openssl s_client with the mesh certificate, ALPN h2, whose
// standard input the test writes HTTP/2 bytes to.
type sClient struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
}

func startSClient(t testing.TB, addr, cert, key string) *sClient {
	t.Helper()
	openssl := realClient(t, "openssl", "openssl")
	cmd := exec.Command(openssl, "s_client", "-quiet", "-nocommands", "-connect", addr, "-cert", cert, "-key", key, "-alpn", "h2")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return &sClient{cmd: cmd, stdin: stdin}
}

// liveHeap is the live heap after a collection.
func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestOpenSSLStalledLargeFrames: openssl s_client clients with the mesh's
// certificate send the preface and then the 9-byte header of a frame the
// framer buffers (not DATA), declaring 1 MiB (our SETTINGS_MAX_FRAME_SIZE,
// which is for DATA), and stop: a PING, an unknown type, and a CONTINUATION
// of an open header block. The server must not hold what a peer only
// declared: before, x/net's framer allocated each frame's whole declared
// length before reading it, so 9 bytes pinned 1 MiB for as long as the
// client kept the connection (the idle timeout, 5 min), and the 1024
// connections one address may hold pinned 1 GiB, the agent's memory limit.
// A frame larger than any such frame of an honest peer now closes the
// connection (ENHANCE_YOUR_CALM, counted), and an unknown one is skipped
// without being buffered.
func TestOpenSSLStalledLargeFrames(t *testing.T) {
	good, _ := pkis()
	srv, addr := serveLoopback(t, ServerOptions{TLSConfig: good.serverTLS(), Handler: func(context.Context, *ServerRequest) Response {
		return Response{Status: 403}
	}})
	cert, key := good.pemFiles(t)
	base := liveHeap()

	const perKind = 8
	const declared = maxReadFrameSize
	frames := map[string]func(fr *http2.Framer, b *bytes.Buffer){
		"PING": func(_ *http2.Framer, b *bytes.Buffer) { writeFrameHeader(b, declared, http2.FramePing, 0, 0) },
		"unknown": func(_ *http2.Framer, b *bytes.Buffer) {
			writeFrameHeader(b, declared, 0xfa, 0, 0)
		},
		"CONTINUATION": func(fr *http2.Framer, b *bytes.Buffer) {
			_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0x82}, EndHeaders: false})
			writeFrameHeader(b, declared, http2.FrameContinuation, 0, 1)
		},
	}
	var clients []*sClient
	for kind, frame := range frames {
		for range perKind {
			c := startSClient(t, addr, cert, key)
			var b bytes.Buffer
			b.WriteString(http2.ClientPreface)
			fr := http2.NewFramer(&b, nil)
			_ = fr.WriteSettings()
			frame(fr, &b)
			b.Write([]byte("a few bytes of the payload"))
			if _, err := c.stdin.Write(b.Bytes()); err != nil {
				t.Fatalf("%s: %v", kind, err)
			}
			clients = append(clients, c)
		}
	}
	n := uint64(len(clients))
	waitfor.Until(t, "every client's handshake and preface", func() bool {
		st := srv.Stats()
		return st.ConnsAccepted == n && srv.limiter.Stats().Handshakes == 0
	})
	// Let the readers reach the stalled frame.
	time.Sleep(500 * time.Millisecond)
	// What a connection costs anyway (TLS and framer buffers, some 20-40
	// KiB) is well under the allowance; a declared frame is 1 MiB.
	if after, limit := liveHeap(), n*128<<10; after > base+limit {
		t.Errorf("live heap %d KiB over the server's start with %d clients stalled in a frame declaring %d bytes, want under %d KiB",
			(after-base)>>10, n, declared, limit>>10)
	}
	if st := srv.Stats(); st.ConnsFlood < 2*perKind {
		t.Errorf("ConnsFlood = %d, want the %d connections stalled in a PING or CONTINUATION of 1 MiB closed as floods", st.ConnsFlood, 2*perKind)
	}
	runtime.KeepAlive(clients)
}

// writeFrameHeader writes a bare frame header, as a peer that sends the
// payload later (or never).
func writeFrameHeader(b *bytes.Buffer, length int, typ http2.FrameType, flags http2.Flags, id uint32) {
	b.Write([]byte{byte(length >> 16), byte(length >> 8), byte(length), byte(typ), byte(flags),
		byte(id >> 24), byte(id >> 16), byte(id >> 8), byte(id)})
}

// TestNghttpConnectionErrorsExplained: a connection error the client caused
// comes with its reason in the GOAWAY's debug data, which nghttp prints:
// here a header field longer than the header list size we advertise
// (COMPRESSION_ERROR: HPACK cannot skip it), and a 300-field header block
// (PROTOCOL_ERROR: x/net refuses a fragment that large). Before, every
// GOAWAY went without debug data, and the client's operator saw only the
// code.
func TestNghttpConnectionErrorsExplained(t *testing.T) {
	nghttp := realClient(t, "nghttp", "nghttp2-client")
	good, _ := pkis()
	_, addr := serveLoopback(t, ServerOptions{TLSConfig: good.serverTLS(), Handler: func(context.Context, *ServerRequest) Response {
		return Response{Status: 403}
	}})
	cert, key := good.pemFiles(t)
	many := []string{}
	for i := range 300 {
		many = append(many, "-H", fmt.Sprintf("x-field-%d: %s", i, strings.Repeat("v", 100)))
	}
	for name, headers := range map[string][]string{
		"one long field": {"-H", "x-big: " + strings.Repeat("a", 20000)},
		"300 fields":     many,
	} {
		args := append([]string{"-v", "-t", "10", "--cert", cert, "--key", key}, headers...)
		out, _ := exec.Command(nghttp, append(args, "https://"+addr+"/")...).CombinedOutput()
		goaway := ""
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, "last_stream_id") && strings.Contains(line, "error_code=") && !strings.Contains(line, "NO_ERROR") {
				goaway = line
			}
		}
		if goaway == "" {
			t.Errorf("%s: nghttp got no GOAWAY with an error:\n%s", name, out)
			continue
		}
		if strings.Contains(goaway, "opaque_data(0)") {
			t.Errorf("%s: the GOAWAY carries no reason: %s", name, strings.TrimSpace(goaway))
		} else {
			t.Logf("%s: %s", name, strings.TrimSpace(goaway))
		}
	}
}

// TestNghttpAtStreamLimitNotRefused: nghttp sending 3000 requests on one
// connection keeps to our SETTINGS_MAX_CONCURRENT_STREAMS (200), opening a
// stream as soon as it read the end of another: none may be refused. Before,
// a stream our END_STREAM closed still counted until the goroutine that
// wrote it forgot it, so the client's next HEADERS, sent on reading that
// END_STREAM, was often refused (REFUSED_STREAM, some 100 to 600 per run),
// and the refusals, charged as junk, closed the connection as a flood
// (ENHANCE_YOUR_CALM) after about a thousand: an honest client at the limit
// lost every stream.
func TestNghttpAtStreamLimitNotRefused(t *testing.T) {
	nghttp := realClient(t, "nghttp", "nghttp2-client")
	good, _ := pkis()
	srv, addr := serveLoopback(t, ServerOptions{TLSConfig: good.serverTLS(), Handler: func(context.Context, *ServerRequest) Response {
		return Response{Status: 403}
	}})
	cert, key := good.pemFiles(t)
	out, err := exec.Command(nghttp, "-n", "-m", "3000", "-t", "60", "--cert", cert, "--key", key, "https://"+addr+"/").CombinedOutput()
	if err != nil {
		t.Logf("nghttp: %v\n%s", err, out)
	}
	st := srv.Stats()
	if st.StreamsRefused != 0 || st.ConnsFlood != 0 {
		t.Errorf("%d streams refused, %d connections closed as floods, want none for a client within the stream limit", st.StreamsRefused, st.ConnsFlood)
	}
	if st.StreamsBadRequest != 3000 {
		t.Errorf("%d requests answered (405), want 3000", st.StreamsBadRequest)
	}
}
