package netnstest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/accel"
	"github.com/redirector-mesh/redirector/pkg/netns"
)

// accelTotals sums the acceleration's counters of every agent: both
// simulated nodes attach to this machine's one cgroup.
func accelTotals(t *testing.T, ms *mesh) accel.Counters {
	t.Helper()
	var sum accel.Counters
	for _, a := range ms.agents {
		c, err := accel.PinnedCounters(a.BPFRoot)
		if err != nil {
			t.Fatal(err)
		}
		sum = sum.Add(c)
	}
	return sum
}

func dialPod(t *testing.T, ctx context.Context, from, to *Pod, port uint16) net.Conn {
	t.Helper()
	var c net.Conn
	Eventually(t, 10*time.Second, func() error {
		var err error
		c, err = netns.Dial(ctx, from.Path(), "tcp", netip.AddrPortFrom(to.IPv4, port).String(), netns.SocketOptions{})
		return err
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// exchangeMirror sends size bytes, half-closes, and checks that the size
// bytes the mirror sends back are the pattern's.
func exchangeMirror(t *testing.T, c net.Conn, size int64) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, io.LimitReader(newPattern(), size))
		if err == nil {
			err = c.(*net.TCPConn).CloseWrite()
		}
		errc <- err
	}()
	got, want := sha256.New(), sha256.New()
	n, err := io.Copy(got, c)
	if err != nil || n != size {
		t.Fatalf("read back %d of %d bytes: %v", n, size, err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("send: %v", err)
	}
	io.Copy(want, io.LimitReader(newPattern(), size))
	if !bytes.Equal(got.Sum(nil), want.Sum(nil)) {
		t.Fatal("the bytes that came back differ from those sent")
	}
}

// TestSockopsAcceleration runs apps through the mesh with the acceleration
// on. What a user relies on: every byte arrives, in order, whatever the
// app's write pattern or copy method; an app never sees an error the TCP
// path would not give it; a long request/response connection keeps the
// fast path.
func TestSockopsAcceleration(t *testing.T) {
	var client, server, plain *Pod
	ms := newMeshWith(t, []string{"--sockops-acceleration=true"}, func(tp *Topology, m *Manifest) {
		client, server, plain = tp.Nodes[0].AddPod("client"), tp.Nodes[1].AddPod("server"), tp.Nodes[0].AddPod("plain")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
			Pod(client, "mesh", "client").Pod(server, "mesh", "server").Pod(plain, "plain", "default")
	})
	// io.Copy between two TCP sockets is splice(2) in Go, and from a file
	// sendfile(2): the apps use the kernel's other copy paths.
	ServeTCP(t, server, 9300, func(c net.Conn) { io.Copy(c, c) })
	mirrorServer(t, server, 9000)
	mirrorServer(t, plain, 9000)
	stalled := make(chan struct{})
	ServeTCP(t, server, 9100, func(c net.Conn) {
		<-stalled // reads nothing until the client has written for a while
		h := sha256.New()
		if _, err := io.Copy(h, c); err == nil {
			io.WriteString(c, hex.EncodeToString(h.Sum(nil))+"\n")
		}
	})
	file := filepath.Join(t.TempDir(), "payload")
	const fileSize = 32 << 20
	payload, _ := io.ReadAll(io.LimitReader(newPattern(), fileSize))
	if err := os.WriteFile(file, payload, 0o600); err != nil {
		t.Fatal(err)
	}
	sinkServer(t, server, 9500)
	ServeTCP(t, server, 9600, func(c net.Conn) {}) // closes at once
	ServeTCP(t, server, 9400, func(c net.Conn) {
		f, err := os.Open(file)
		if err != nil {
			return
		}
		defer f.Close()
		io.Copy(c, f)
	})
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	t.Run("requests and replies stay socket to socket", func(t *testing.T) {
		c := dialPod(t, ctx, client, server, 9300)
		// The kernel pairs the tunnel's socket when it takes the
		// handshake's last ACK, which can be a moment after connect
		// returns; a first write before that puts the connection on TCP
		// (counted as no_peer), which is not what this case is about.
		time.Sleep(20 * time.Millisecond)
		before := accelTotals(t, ms)
		const rounds, size = 1000, 2048 // 2 MiB each way: 8 times the budget
		msg, buf := make([]byte, size), make([]byte, size)
		p := newPattern()
		for i := range rounds {
			p.Read(msg)
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.Write(msg); err != nil {
				t.Fatalf("round %d: write: %v", i, err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				t.Fatalf("round %d: read: %v", i, err)
			}
			if !bytes.Equal(msg, buf) {
				t.Fatalf("round %d: the echo differs from the request", i)
			}
		}
		d := accelTotals(t, ms).Sub(before)
		t.Logf("counters: %+v", d)
		if d.FallbackNoPeer != 0 {
			t.Fatalf("the connection went to TCP at its first write (%d no_peer fall-backs): the tunnel's socket was not paired yet", d.FallbackNoPeer)
		}
		// The client app's requests and the server app's replies: two hops
		// of rounds*size bytes each, all socket to socket, because the
		// tunnel's reads keep giving the budget back.
		if d.RedirectedBytes < 2*rounds*size {
			t.Errorf("%d bytes moved socket to socket, want both app-to-tunnel hops (%d)", d.RedirectedBytes, 2*rounds*size)
		}
		if d.FallbackBudget != 0 {
			t.Errorf("%d connections ran out of budget while the tunnel kept up", d.FallbackBudget)
		}
	})

	t.Run("a stalled reader makes the app's sends wait, not fail", func(t *testing.T) {
		c := dialPod(t, ctx, client, server, 9100)
		before := accelTotals(t, ms)
		const size = 64 << 20
		h := sha256.New()
		done := make(chan error, 1)
		go func() {
			_, err := io.Copy(c, io.TeeReader(io.LimitReader(newPattern(), size), h))
			done <- err
		}()
		time.Sleep(time.Second)
		close(stalled)
		if err := <-done; err != nil {
			t.Fatalf("send while the server stalled: %v", err)
		}
		c.(*net.TCPConn).CloseWrite()
		reply, err := bufio.NewReader(c).ReadString('\n')
		if err != nil || strings.TrimSpace(reply) != hex.EncodeToString(h.Sum(nil)) {
			t.Fatalf("the server read sha256 %q (%v), want the client's", reply, err)
		}
		d := accelTotals(t, ms).Sub(before)
		t.Logf("counters: %+v", d)
		if d.FallbackBudget == 0 {
			t.Error("the client app kept redirecting while nobody read: no budget fallback counted")
		}
		// Once the tunnel saw the fall-back it unpaired the app's socket:
		// most of the 2048 writes of 32 KiB ran no sk_msg program at all.
		if d.Passed >= size/(32<<10)/2 {
			t.Errorf("%d of the app's sends still ran the sk_msg program after its fall-back", d.Passed)
		}
	})

	t.Run("bulk both ways with half-close", func(t *testing.T) {
		exchangeMirror(t, dialPod(t, ctx, client, server, 9000), 256<<20)
	})

	t.Run("sendfile", func(t *testing.T) {
		c := dialPod(t, ctx, client, server, 9400)
		got, err := io.ReadAll(c)
		if err != nil || !bytes.Equal(got, payload) {
			t.Fatalf("read %d of %d bytes sent with sendfile, equal %v: %v", len(got), fileSize, bytes.Equal(got, payload), err)
		}
	})

	t.Run("passthrough to a pod outside the mesh", func(t *testing.T) {
		before := accelTotals(t, ms)
		exchangeMirror(t, dialPod(t, ctx, client, plain, 9000), 16<<20)
		if d := accelTotals(t, ms).Sub(before); d.RedirectedBytes == 0 {
			t.Errorf("nothing moved socket to socket on the way out of the mesh: %+v", d)
		}
	})

	t.Run("TCP Fast Open: bytes sent before pairing stay first", func(t *testing.T) {
		before := accelTotals(t, ms)
		sum, reply := fastOpenSend(t, client, netip.AddrPortFrom(server.IPv4, 9500), 200, 1024)
		if reply != sum {
			t.Fatalf("the server read sha256 %q, want the client's %q", reply, sum)
		}
		if d := accelTotals(t, ms).Sub(before); d.FallbackEarly == 0 {
			t.Errorf("a connection whose first write went out before pairing was not put on TCP: %+v", d)
		}
	})

	t.Run("the app gets TCP's errors once the tunnel is gone", func(t *testing.T) {
		c := dialPod(t, ctx, client, server, 9600)
		time.Sleep(20 * time.Millisecond)
		msg := make([]byte, 1024)
		var err error
		for end := time.Now().Add(10 * time.Second); err == nil && time.Now().Before(end); time.Sleep(time.Millisecond) {
			_, err = c.Write(msg)
		}
		// The server closed at once, so the tunnel closed the app's
		// connection. Whatever the tunnel's socket is by then (gone, or
		// closed but not yet TCP_CLOSE, which rd_sk_msg finds out from a
		// failed redirect), the app must get TCP's error, never the
		// EACCES of a dropped redirect.
		if !errors.Is(err, syscall.EPIPE) && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("writing after the peer closed: %v, want EPIPE or ECONNRESET", err)
		}
	})

	t.Run("metrics match the counters", func(t *testing.T) {
		for _, a := range ms.agents {
			text := scrape(t, a, "http://127.0.0.1:15020/metrics")
			want, err := accel.PinnedCounters(a.BPFRoot)
			if err != nil {
				t.Fatal(err)
			}
			got := metricSum(text, "redirector_sockops_redirected_bytes_total")
			if got != float64(want.RedirectedBytes) {
				t.Errorf("%s: redirector_sockops_redirected_bytes_total %v, map says %d", a.Node.Name, got, want.RedirectedBytes)
			}
			if got := metricSum(text, "redirector_sockops_fallbacks_total", `reason="budget"`); got != float64(want.FallbackBudget) {
				t.Errorf("%s: budget fallbacks %v in metrics, %d in the map", a.Node.Name, got, want.FallbackBudget)
			}
		}
	})
}

// fastOpenSend sends from pod p to dst on a blocking socket, the first of
// n messages of size bytes with sendto(MSG_FASTOPEN): with no cookie the
// kernel sends a plain SYN and writes that message from inside the call once
// connected, before the socket was paired, so it bypasses sk_msg. Then it
// writes the others, half-closes and returns the sha256 it sent and the
// line the sink server answered.
func fastOpenSend(t *testing.T, p *Pod, dst netip.AddrPort, n, size int) (sum, reply string) {
	t.Helper()
	var fd int
	err := netns.Do(p.Path(), func() error {
		var err error
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	tv := unix.Timeval{Sec: 10}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	sa := &unix.SockaddrInet4{Addr: dst.Addr().As4(), Port: int(dst.Port())}
	h := sha256.New()
	src := newPattern()
	msg := make([]byte, size)
	for i := range n {
		src.Read(msg)
		h.Write(msg)
		if i == 0 {
			err = unix.Sendto(fd, msg, unix.MSG_FASTOPEN, sa)
		} else {
			_, err = unix.Write(fd, msg)
		}
		if err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
	}
	if err := unix.Shutdown(fd, unix.SHUT_WR); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 128)
	var got []byte
	deadline := time.Now().Add(10 * time.Second)
	for {
		k, err := unix.Read(fd, buf)
		if err == unix.EAGAIN && time.Now().Before(deadline) {
			// A known limit of sockmap sockets: the kernel's
			// tcp_bpf_recvmsg returns EAGAIN to a blocking read woken
			// by anything but data (here the ACK of our FIN).
			continue
		}
		if err != nil {
			t.Fatalf("read the reply: %v", err)
		}
		if k == 0 {
			break
		}
		got = append(got, buf[:k]...)
	}
	return hex.EncodeToString(h.Sum(nil)), strings.TrimSpace(string(got))
}
