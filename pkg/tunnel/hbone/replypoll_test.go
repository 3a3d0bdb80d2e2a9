package hbone

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// answererChildEnv makes a run of this test binary the answerer app of
// startAnswererProcess instead of running the tests.
const answererChildEnv = "REDIRECTOR_HBONE_TEST_ANSWERER"

func TestMain(m *testing.M) {
	if os.Getenv(answererChildEnv) != "" {
		os.Exit(answererChild())
	}
	os.Exit(m.Run())
}

// answererChild serves answerer(0) on a loopback port it prints, until its
// stdin closes (the test ended, or its process died).
func answererChild() int {
	l, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(l.Addr())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}()
	serve := answerer(0)
	for {
		c, err := l.AcceptTCP()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		go func() {
			defer c.Close()
			serve(c)
		}()
	}
}

// startAnswererProcess runs answerer(0) in a process of its own (this test
// binary run again), as an app is, and returns its address. The process
// ends with the test.
func startAnswererProcess(t *testing.T) netip.AddrPort {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), answererChildEnv+"=1")
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the answerer process: %v", err)
	}
	t.Cleanup(func() {
		_ = stdin.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("the answerer process gave no address: %v", err)
	}
	addr, err := netip.ParseAddrPort(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("the answerer process's address: %v", err)
	}
	return addr
}

// withReplyPoll turns reply polling on for a test and off after it.
func withReplyPoll(t *testing.T, cfg ReplyPollConfig) {
	t.Helper()
	if err := SetReplyPoll(cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = SetReplyPoll(ReplyPollConfig{}) })
}

// answeredRoundTrips sends n one-byte requests over s, each after the answer to the
// one before, and checks the answers.
func answeredRoundTrips(t *testing.T, s *Stream, n int) {
	t.Helper()
	b := []byte{0}
	for i := range n {
		b[0] = byte(i)
		if _, err := s.Write(b); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(s, b); err != nil {
			t.Fatal(err)
		}
		if b[0] != byte(i)+1 {
			t.Fatalf("answer %d: got %d, want %d", i, b[0], byte(i)+1)
		}
	}
}

// answerer is an app that answers every byte with the byte plus one, after delay.
func answerer(delay time.Duration) func(*net.TCPConn) {
	return func(c *net.TCPConn) {
		b := []byte{0}
		for {
			if _, err := io.ReadFull(c, b); err != nil {
				return
			}
			time.Sleep(delay)
			b[0]++
			if _, err := c.Write(b); err != nil {
				return
			}
		}
	}
}

func polls() uint64 {
	p := ReplyPolls()
	return p.Caught + p.Tunnel + p.Expired + p.Budget + p.Busy
}

// The server's reader, after delivering a request to an app that answers at
// once, polls instead of parking and sees data come: the answer, or (where
// the server's writer and the client get another CPU and finish the round
// trip while the reader yields) the next request. The app is a process of
// its own, as apps are: the poll holds its goroutine's P without entering
// the scheduler, so with one P (-cpu=1, or GOMAXPROCS=1 on a node) an app
// running as a goroutine of this process could never answer during a poll,
// and every poll expired.
func TestReplyPollCatchesAnswers(t *testing.T) {
	withReplyPoll(t, ReplyPollConfig{Window: maxReplyPollWindow, CPU: 1})
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	s, err := e.connect(context.Background(), startAnswererProcess(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	before := ReplyPolls()
	answeredRoundTrips(t, s, 200)
	after := ReplyPolls()
	if after.Caught+after.Tunnel == before.Caught+before.Tunnel {
		t.Fatalf("no poll saw data in 200 round trips: %+v", after)
	}
	if after.Spent <= before.Spent {
		t.Errorf("polls spent no time: %+v", after)
	}
}

// An app that takes longer than answerFactor times the window to answer is never polled
// for, nor is any app with reply polling off.
func TestReplyPollSkipsSlowAnswers(t *testing.T) {
	for _, tc := range []struct {
		name   string
		window time.Duration
		delay  time.Duration
	}{
		{"slow app", 50 * time.Microsecond, 2 * time.Millisecond},
		{"off", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			withReplyPoll(t, ReplyPollConfig{Window: tc.window, CPU: 1})
			e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
			s, err := e.connect(context.Background(), startUpstream(t, answerer(tc.delay)))
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			before := polls()
			answeredRoundTrips(t, s, 30)
			if n := polls() - before; n != 0 {
				t.Fatalf("%d polls for answers that came %v after the request", n, tc.delay)
			}
		})
	}
}

// The budget lends what its CPU share earned since the last refill, at most
// replyPollBurst, and nothing once spent.
func TestReplyPollBudget(t *testing.T) {
	withReplyPoll(t, ReplyPollConfig{Window: 50 * time.Microsecond, CPU: 0.1})
	now := int64(time.Hour)
	pollRefilled.Store(now)
	pollTokens.Store(0)
	if takePollTokens(now) {
		t.Fatal("an empty budget lent time")
	}
	if !takePollTokens(now + int64(time.Millisecond)) {
		t.Fatal("1ms at a 0.1 share earned nothing")
	}
	if got, want := pollTokens.Load(), int64(100*time.Microsecond); got != want {
		t.Fatalf("1ms at a 0.1 share earned %v, want %v", time.Duration(got), time.Duration(want))
	}
	pollTokens.Add(-int64(100 * time.Microsecond))
	if takePollTokens(now + int64(time.Millisecond)) {
		t.Fatal("a spent budget lent time")
	}
	takePollTokens(now + int64(time.Hour)) // a long pause: saves at most the burst
	if got := pollTokens.Load(); got != replyPollBurst {
		t.Fatalf("after a long pause the budget holds %v, want %v", time.Duration(got), time.Duration(replyPollBurst))
	}
}

func TestReplyPollSetting(t *testing.T) {
	for _, bad := range []ReplyPollConfig{
		{Window: -time.Microsecond, CPU: 0.5},
		{Window: 2 * maxReplyPollWindow, CPU: 0.5},
		{Window: 50 * time.Microsecond, CPU: 0},
		{Window: 50 * time.Microsecond, CPU: 1.5},
	} {
		if err := CheckReplyPoll(bad); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
	for _, good := range []ReplyPollConfig{{}, {Window: 50 * time.Microsecond, CPU: 0.25}, {Window: maxReplyPollWindow, CPU: 1}} {
		if err := CheckReplyPoll(good); err != nil {
			t.Errorf("%+v: %v", good, err)
		}
	}
}

// A delivery is polled after only when its stream's app answers fast and no
// other stream was delivered to within replyPollQuiet (a client's burst: the
// apps want the CPUs).
func TestReplyPollArming(t *testing.T) {
	withReplyPoll(t, ReplyPollConfig{Window: 50 * time.Microsecond, CPU: 1})
	c := &conn{replyFd: -1}
	a, b := &Stream{c: c}, &Stream{c: c}
	a.answersFast.Store(true)
	b.answersFast.Store(true)
	lastArmed.Store(0)
	lastArmedAt.Store(0)
	steps := []struct {
		what   string
		s      *Stream
		before func()
		want   int32
	}{
		{"a lone stream", a, nil, 1},
		{"the same stream again", a, nil, 1},
		{"another stream right after", b, nil, -1},
		{"the first again right after", a, nil, -1},
		{"a stream after a quiet spell", b, func() { lastArmedAt.Store(monotonic() - 2*int64(replyPollQuiet)) }, 2},
		{"a stream whose app answers slowly", b, func() { b.answersFast.Store(false) }, -1},
	}
	for _, st := range steps {
		if st.before != nil {
			st.before()
		}
		fd := 1
		if st.s == b {
			fd = 2
		}
		c.armReplyPoll(st.s, fd)
		if c.replyFd != st.want {
			t.Errorf("%s: armed for %d, want %d", st.what, c.replyFd, st.want)
		}
	}
}
