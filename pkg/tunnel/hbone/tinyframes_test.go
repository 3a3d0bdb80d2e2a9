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
	rc := newRawClientOver(t, tc)
	if err := rc.connect(1, app.String()); err != nil {
		t.Fatal(err)
	}
	if st := rc.waitFor("the answer to CONNECT", func(f rawFrame) bool { return f.typ == http2.FrameHeaders }).status; st != 200 {
		t.Fatalf("CONNECT answered %d, want 200", st)
	}

	// Every frame in one write, so the server reads many in one read.
	var out bytes.Buffer
	fr := http2.NewFramer(&out, nil)
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
