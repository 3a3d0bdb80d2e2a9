package hbone

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// writeSyscalls is this process's count of write(2)-like calls (syscw).
func writeSyscalls(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		t.Skipf("no /proc/self/io: %v", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "syscw: "); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	t.Skip("no syscw in /proc/self/io")
	return 0
}

// TestTinyDataFramesCoalesced: a client that packs one stream's bytes into
// DATA frames of one byte each (10 bytes on the wire, 1600 in a TLS
// record) must not make the server write them to the application one
// write(2) (and one TCP segment to the app) each: that is a flood of work
// for a few bytes of the client's, beyond what the same bytes cost in
// honest frames. Every byte still arrives, in order.
func TestTinyDataFramesCoalesced(t *testing.T) {
	const frames = 16000
	var got atomic.Int64
	var gotBuf bytes.Buffer
	done := make(chan struct{})
	app := startUpstream(t, func(c *net.TCPConn) {
		buf := make([]byte, 64<<10)
		for {
			n, err := c.Read(buf)
			gotBuf.Write(buf[:n])
			if got.Add(int64(n)) >= frames {
				close(done)
				_, _ = io.Copy(io.Discard, c)
				return
			}
			if err != nil {
				return
			}
		}
	})
	_, addr := serveLoopback(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	good, _ := pkis()
	conf := good.clientTLS()
	conf.NextProtos = []string{"h2"}
	tc, err := tls.Dial("tcp", addr, conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tc.Close() })
	var out bytes.Buffer
	out.WriteString(http2.ClientPreface)
	fr := http2.NewFramer(&out, nil)
	_ = fr.WriteSettings()
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	_ = enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
	_ = enc.WriteField(hpack.HeaderField{Name: ":authority", Value: app.String()})
	_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
	if _, err := tc.Write(out.Bytes()); err != nil {
		t.Fatal(err)
	}
	ok := make(chan int, 1)
	go func() {
		rfr := http2.NewFramer(nil, tc)
		rfr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
		for {
			f, err := rfr.ReadFrame()
			if err != nil {
				ok <- 0
				return
			}
			if h, isH := f.(*http2.MetaHeadersFrame); isH {
				st, _ := strconv.Atoi(h.PseudoValue("status"))
				ok <- st
			}
		}
	}()
	select {
	case st := <-ok:
		if st != 200 {
			t.Fatalf("CONNECT answered %d, want 200", st)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no answer to CONNECT")
	}

	out.Reset()
	want := make([]byte, frames)
	for i := range want {
		want[i] = byte('a' + i%26)
		_ = fr.WriteData(1, false, want[i:i+1])
	}
	before := writeSyscalls(t)
	if _, err := tc.Write(out.Bytes()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("the application got %d of %d bytes", got.Load(), frames)
	}
	writes := writeSyscalls(t) - before
	t.Logf("%d one-byte DATA frames (%d bytes on the wire) took %d write calls in this process", frames, out.Len(), writes)
	if !bytes.Equal(gotBuf.Bytes()[:frames], want) {
		t.Fatal("the application got the bytes out of order")
	}
	// About 660 here; race builds, whose reader is slower next to the
	// stream's writer, about 2300: the writer writes what gathered each
	// time it wakes. One per frame was 16000; half that leaves a loaded
	// machine's scheduling room and still catches it.
	if writes > frames/2 {
		t.Errorf("%d write calls for %d one-byte frames: want them coalesced (at most %d)", writes, frames, frames/2)
	}
}
