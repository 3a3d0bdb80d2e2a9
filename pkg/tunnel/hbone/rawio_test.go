package hbone

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// tcpPair returns the two ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client, server *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan *net.TCPConn, 1)
	go func() {
		c, _ := ln.AcceptTCP()
		accepted <- c
	}()
	c, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	s := <-accepted
	if s == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { _ = c.Close(); _ = s.Close() })
	return c, s
}

// TestRawSockIsATCPConn: reads and writes through rawSock behave as net.TCPConn's do: bytes in
// order across waits for the poller, io.EOF at the peer's close, the deadline's error, the closed
// socket's error, and a reset peer's error as a *net.OpError wrapping the errno.
func TestRawSockIsATCPConn(t *testing.T) {
	c, s := tcpPair(t)
	rc, rs := newRawSock(c), newRawSock(s)
	if rc == nil || rs == nil {
		t.Fatal("no rawSock for a *net.TCPConn")
	}
	if newRawSock(&writeRecorder{}) != nil {
		t.Fatal("a wrapper got a rawSock: its own Read and Write would be bypassed")
	}

	// 8 MiB: more than the socket buffers hold, so both sides wait in the poller.
	want := bytes.Repeat([]byte("0123456789abcdef"), 512<<10)
	werr := make(chan error, 1)
	go func() {
		n, err := rc.Write(want)
		if err == nil && n != len(want) {
			err = io.ErrShortWrite
		}
		werr <- err
	}()
	got := make([]byte, 0, len(want))
	buf := make([]byte, 100_000)
	for len(got) < len(want) {
		n, err := rs.Read(buf)
		if err != nil {
			t.Fatalf("read after %d bytes: %v", len(got), err)
		}
		got = append(got, buf[:n]...)
	}
	if err := <-werr; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the bytes read differ from the bytes written")
	}

	// A deadline ends a waiting read with the deadline's error.
	_ = s.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := rs.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past the deadline: %v, want os.ErrDeadlineExceeded", err)
	}
	_ = s.SetReadDeadline(time.Time{})

	// The peer's close is io.EOF.
	_ = c.CloseWrite()
	if n, err := rs.Read(buf); n != 0 || err != io.EOF {
		t.Fatalf("read after the peer's close: %d, %v, want 0, io.EOF", n, err)
	}

	// A reset peer: the write fails with the errno, wrapped as net.TCPConn wraps it.
	_ = c.SetLinger(0)
	_ = c.Close()
	time.Sleep(10 * time.Millisecond)
	var err error
	for range 100 { // the first write may be taken before the reset is seen
		if _, err = rs.Write([]byte("x")); err != nil {
			break
		}
	}
	var op *net.OpError
	if !errors.As(err, &op) || !(errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)) {
		t.Fatalf("write to a reset peer: %v, want a *net.OpError of ECONNRESET or EPIPE", err)
	}

	// A closed socket's read is net.ErrClosed, as net.TCPConn's is.
	_ = s.Close()
	if _, err := rs.Read(buf); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read of a closed socket: %v, want net.ErrClosed", err)
	}
}

// echoPair is a raw client socket whose peer echoes every byte back until the test ends.
func echoPair(t *testing.T) *rawSock {
	c, s := tcpPair(t)
	rc, rs := newRawSock(c), newRawSock(s)
	go func() {
		buf := make([]byte, 1)
		for {
			if _, err := rs.Read(buf); err != nil {
				return
			}
			if _, err := rs.Write(buf); err != nil {
				return
			}
		}
	}()
	return rc
}

// rawRoundTrips makes 1-byte round trips on rc for d and says how many.
func rawRoundTrips(t *testing.T, rc *rawSock, d time.Duration) uint64 {
	t.Helper()
	buf := []byte{1}
	var trips uint64
	for end := time.Now().Add(d); time.Now().Before(end); trips++ {
		if _, err := rc.Write(buf); err != nil {
			t.Fatal(err)
		}
		if _, err := rc.Read(buf); err != nil {
			t.Fatal(err)
		}
	}
	return trips
}

// TestOrdinaryCallsKeepSysmonAwake: while the data path is busy, one call in ordinaryEvery is an
// ordinary one (which wakes the runtime's monitor), the rest are raw.
func TestOrdinaryCallsKeepSysmonAwake(t *testing.T) {
	if raceEnabled {
		t.Skip("race builds make every call an ordinary one (rawio.go); this checks the mix")
	}
	rc := echoPair(t)
	ord0 := ordinaryCalls.Load()
	start := time.Now()
	// At least 300 ms, and on until one ordinary call was made (up to 5 s):
	// on a loaded machine a round trip may take longer than idleGap, which
	// ends the busy stretch, so a stretch of ordinaryEvery can take a while
	// to come.
	var trips uint64
	for time.Since(start) < 300*time.Millisecond || ordinaryCalls.Load() == ord0 && time.Since(start) < 5*time.Second {
		trips += rawRoundTrips(t, rc, 50*time.Millisecond)
	}
	elapsed := time.Since(start)
	// Each round trip made at least four calls (a write and a read on each side); every call
	// that was not an ordinary one was a raw one.
	ord := ordinaryCalls.Load() - ord0
	maxOrd := uint64(elapsed/ordinaryEvery) + 2
	if ord == 0 || ord > maxOrd {
		t.Fatalf("%d ordinary calls in %v of round trips, want 1 to %d (one per %v)", ord, elapsed, maxOrd, ordinaryEvery)
	}
	if 4*trips < 100*ord {
		t.Fatalf("%d ordinary calls in %d round trips: the raw path is not the common one", ord, trips)
	}
}

// TestBurstsLeaveSysmonAsleep: a load in bursts, each shorter than ordinaryEvery and followed by
// a pause (fortio's 16 connections at 1000 qps), makes no ordinary call: every call is raw, so
// the bursts do not wake the runtime's monitor. The same calls without the pauses do make them
// (TestOrdinaryCallsKeepSysmonAwake).
func TestBurstsLeaveSysmonAsleep(t *testing.T) {
	if raceEnabled {
		t.Skip("race builds make every call an ordinary one (rawio.go); this checks the mix")
	}
	rc := echoPair(t)
	time.Sleep(2 * idleGap)
	ord0 := ordinaryCalls.Load()
	var trips uint64
	for range 40 {
		trips += rawRoundTrips(t, rc, 2*time.Millisecond)
		time.Sleep(3 * idleGap)
	}
	if ord := ordinaryCalls.Load() - ord0; ord != 0 {
		t.Fatalf("%d ordinary calls in 40 bursts of 2ms (%d round trips), want none", ord, trips)
	}
}
