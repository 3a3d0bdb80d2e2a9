package netnstest

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestSockopsAccelerationZerocopy: an app that sends with MSG_ZEROCOPY
// (SO_ZEROCOPY on its socket, or on the listener its socket was accepted
// from) matches each send with a completion the kernel queues on the
// socket's error queue, and keeps the send's buffer until then; one that
// asks for transmit time stamps (SO_TIMESTAMPING, once connected) gets
// time stamps there that reach each send's last byte. A paired socket's sends take the
// sockmap's path, which copies and reports nothing: before the fix the app
// waited for reports that never came (none of 4 sends completed or time
// stamped, where TCP reports all 4). Such a socket now stays unpaired, or
// falls back to TCP at its first send once it asked, counted as unpaired.
func TestSockopsAccelerationZerocopy(t *testing.T) {
	ms, client, server := sockopsPair(t)
	got := make(chan int64, 1)
	ServeTCP(t, server, 9500, func(c net.Conn) {
		n, _ := io.Copy(io.Discard, c)
		got <- n
	})
	const sends, size = 4, 64 << 10
	// The server app sends from a socket accepted from a SO_ZEROCOPY
	// listener.
	var lfd int
	if err := netns.Do(server.Path(), func() error {
		var err error
		if lfd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		if err := unix.SetsockoptInt(lfd, unix.SOL_SOCKET, unix.SO_ZEROCOPY, 1); err != nil {
			return err
		}
		if err := unix.Bind(lfd, &unix.SockaddrInet4{Port: 9600}); err != nil {
			return err
		}
		return unix.Listen(lfd, 8)
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(lfd) })
	serverDone := make(chan int, 1)
	go func() {
		fd, _, err := unix.Accept4(lfd, unix.SOCK_CLOEXEC)
		if err != nil {
			serverDone <- -1
			return
		}
		defer unix.Close(fd)
		time.Sleep(50 * time.Millisecond) // the app's socket pairs at once; the tunnel's may take a moment
		serverDone <- zerocopySends(fd, sends, size)
	}()
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	before := accelTotals(t, ms)

	t.Run("client app", func(t *testing.T) {
		var fd int
		err := netns.Do(client.Path(), func() error {
			var err error
			if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
				return err
			}
			if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ZEROCOPY, 1); err != nil {
				return err
			}
			return unix.Connect(fd, &unix.SockaddrInet4{Addr: server.IPv4.As4(), Port: 9500})
		})
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		time.Sleep(20 * time.Millisecond)
		if n := zerocopySends(fd, sends, size); n != sends {
			t.Errorf("%d of %d MSG_ZEROCOPY sends completed", n, sends)
		}
		unix.Shutdown(fd, unix.SHUT_WR)
		select {
		case n := <-got:
			if n != sends*size {
				t.Errorf("the server read %d bytes, want %d", n, sends*size)
			}
		case <-time.After(10 * time.Second):
			t.Error("the server read nothing")
		}
	})

	t.Run("client app asking for time stamps once connected", func(t *testing.T) {
		paired := accelTotals(t, ms).Sockets
		var fd int
		err := netns.Do(client.Path(), func() error {
			var err error
			if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
				return err
			}
			return unix.Connect(fd, &unix.SockaddrInet4{Addr: server.IPv4.As4(), Port: 9500})
		})
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		// Both ends of the captured connection (the app's socket and the
		// tunnel's) paired before the app asks.
		for end := time.Now().Add(10 * time.Second); accelTotals(t, ms).Sockets-paired < 2; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(end) {
				t.Fatalf("the connection's sockets were not paired: %+v", accelTotals(t, ms).Sub(before))
			}
		}
		// OPT_ID takes an established socket.
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TIMESTAMPING, unix.SOF_TIMESTAMPING_TX_SOFTWARE|
			unix.SOF_TIMESTAMPING_SOFTWARE|unix.SOF_TIMESTAMPING_OPT_ID|unix.SOF_TIMESTAMPING_OPT_TSONLY); err != nil {
			t.Fatal(err)
		}
		if high := timestampedSends(fd, sends, size); high != sends*size-1 {
			t.Errorf("the transmit time stamps of %d sends of %d bytes reached byte %d, want %d", sends, size, high, sends*size-1)
		}
		unix.Shutdown(fd, unix.SHUT_WR)
		select {
		case n := <-got:
			if n != sends*size {
				t.Errorf("the server read %d bytes, want %d", n, sends*size)
			}
		case <-time.After(10 * time.Second):
			t.Error("the server read nothing")
		}
	})

	t.Run("server app", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c := dialPod(t, ctx, client, server, 9600)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		n, err := io.Copy(io.Discard, c)
		if err != nil || n != sends*size {
			t.Errorf("the client read %d bytes (%v), want %d", n, err, sends*size)
		}
		if done := <-serverDone; done != sends {
			t.Errorf("%d of %d MSG_ZEROCOPY sends of the server app completed", done, sends)
		}
	})
	d := accelTotals(t, ms).Sub(before)
	t.Logf("counters: %+v", d)
	if d.Unpaired < 3 {
		t.Errorf("the three app sockets asking for send reports were not left unpaired, counted: %+v", d)
	}
}

// timestampedSends writes n messages of size bytes on fd, which asked for
// software transmit time stamps with OPT_ID, and returns the highest key of
// the time stamps the kernel queued within 10 seconds. TCP's time stamps are
// cumulative: one keyed k reports every byte up to offset k, and the kernel
// merges those of sends that end in one segment (plain TCP over loopback
// often reports 4 such sends with 2) or adds some for pieces of a send, so
// every send was time stamped when the highest key is the last byte's.
func timestampedSends(fd, n, size int) int64 {
	buf := make([]byte, size)
	for range n {
		if _, err := unix.Write(fd, buf); err != nil {
			return -1
		}
	}
	last, high := int64(n*size-1), int64(-1)
	oob := make([]byte, 512)
	for end := time.Now().Add(10 * time.Second); high < last && time.Now().Before(end); {
		_, oobn, _, _, err := unix.Recvmsg(fd, nil, oob, unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
		if err != nil {
			time.Sleep(10 * time.Millisecond)
			continue
		}
		msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
		for _, m := range msgs {
			// struct sock_extended_err: errno u32, origin u8, type u8,
			// code u8, pad u8, info u32, data u32 (the OPT_ID key).
			if m.Header.Level == unix.SOL_IP && m.Header.Type == unix.IP_RECVERR && len(m.Data) >= 16 &&
				m.Data[4] == unix.SO_EE_ORIGIN_TIMESTAMPING {
				high = max(high, int64(binary.NativeEndian.Uint32(m.Data[12:])))
			}
		}
	}
	return high
}

// zerocopySends sends n messages of size bytes with MSG_ZEROCOPY on fd and
// returns how many of them the kernel reported complete within 10 seconds.
func zerocopySends(fd, n, size int) int {
	buf := make([]byte, size)
	for range n {
		if _, err := unix.SendmsgN(fd, buf, nil, nil, unix.MSG_ZEROCOPY); err != nil {
			return -1
		}
	}
	done := 0
	oob := make([]byte, 512)
	for end := time.Now().Add(10 * time.Second); done < n && time.Now().Before(end); {
		_, oobn, _, _, err := unix.Recvmsg(fd, nil, oob, unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
		if err != nil {
			time.Sleep(10 * time.Millisecond)
			continue
		}
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			continue
		}
		for _, m := range msgs {
			// struct sock_extended_err: errno u32, origin u8, type u8,
			// code u8, pad u8, info u32 (first id), data u32 (last id).
			if len(m.Data) < 16 || m.Data[4] != unix.SO_EE_ORIGIN_ZEROCOPY {
				continue
			}
			lo, hi := binary.NativeEndian.Uint32(m.Data[8:]), binary.NativeEndian.Uint32(m.Data[12:])
			done += int(hi-lo) + 1
		}
	}
	return done
}
