package tunnel

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// asUser runs f on a thread of its own whose credentials are uid's (a
// per-thread setresuid, not Go's process-wide one): a socket that thread
// connects or listens on carries uid as its peer credentials. The thread
// is thrown away afterwards.
func asUser(t *testing.T, uid int, f func() error) error {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to change a thread's user")
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, uintptr(uid), uintptr(uid), uintptr(uid)); e != 0 {
			errc <- fmt.Errorf("setresuid: %w", e)
			return
		}
		errc <- f()
	}()
	return <-errc
}

// TestHandoverRefusesOtherUsers: the hand-over socket gives listeners only
// to root or the agent's user. A process of another user that reaches the
// socket (its mode loosened, a directory mounted into another pod) gets no
// descriptor, counted as refused; and a successor refuses a "predecessor"
// socket that another user serves, taking nothing from it and counting it
// as gone (so it puts its own socket at the path).
func TestHandoverRefusesOtherUsers(t *testing.T) {
	ns := podNS(t)
	ctx := context.Background()
	log := newTestLog()
	old := handoverTunnel(t, log, nil)
	if err := old.ServePod(ctx, "pod-a", ns, []netip.Addr{handoverPod}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sock := filepath.Join(dir, "handover.sock")
	sctx, stop := context.WithCancel(ctx)
	served := make(chan error, 1)
	go func() { served <- old.ServeHandover(sctx, sock) }()
	defer func() { stop(); <-served }()
	waitForSocket(t, sock)
	if err := os.Chmod(sock, 0o666); err != nil {
		t.Fatal(err)
	}
	ino, err := netns.Inode(ns)
	if err != nil {
		t.Fatal(err)
	}
	var got int
	err = asUser(t, 65534, func() error {
		c, err := net.Dial("unixpacket", sock)
		if err != nil {
			return err
		}
		defer c.Close()
		if _, err := c.Write([]byte(fmt.Sprintf(`{"netns":%d}`, ino))); err != nil {
			return nil // closed already
		}
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		oob := make([]byte, unix.CmsgSpace(4*3))
		n, oobn, _, _, err := c.(*net.UnixConn).ReadMsgUnix(make([]byte, 512), oob)
		fds, _ := receivedFDs(oob[:oobn])
		got = len(fds)
		closeFDs(fds)
		if err == nil && n > 0 {
			return fmt.Errorf("answered another user")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got != 0 {
		t.Fatalf("a process of uid 65534 received %d descriptors of the pod's listeners", got)
	}
	if n := handoverCount(old, handoverRefused); n != 1 {
		t.Errorf("refused = %v, want 1", n)
	}
	if !strings.Contains(log.String(), "uid 65534") {
		t.Errorf("the refusal does not name the peer:\n%s", log.String())
	}

	// A socket another user serves at the path is no predecessor.
	theirs := filepath.Join(dir, "theirs")
	if err := os.Mkdir(theirs, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(theirs, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	fake := filepath.Join(theirs, "fake.sock")
	var l net.Listener
	if err := asUser(t, 65534, func() error {
		var err error
		l, err = net.Listen("unixpacket", fake)
		return err
	}); err != nil {
		t.Fatalf("listen as another user: %v", err)
	}
	defer l.Close()
	if pred, err := DialPredecessor(ctx, fake); !errors.Is(err, errUntrusted) || pred != nil {
		t.Errorf("DialPredecessor of another user's socket = %v, %v; want errUntrusted", pred, err)
	}
}

// TestHandoverRefusesOtherKindsOfDescriptor: a predecessor's answer whose
// descriptors are no TCP listener (a UDP socket bound to the port, a pipe,
// a file, a unix socket listening), or that carries far more descriptors
// than asked for (the kernel truncates them, MSG_CTRUNC), fails the take
// with an error naming what was wrong; every descriptor received is
// closed, and the pod opens listeners of its own.
func TestHandoverRefusesOtherKindsOfDescriptor(t *testing.T) {
	pod := podNS(t)
	ports := []uint16{15001, 15006, 15008}
	three := func(open func(i int) int) func() []int {
		return func() []int {
			var fds []int
			for i := range ports {
				fds = append(fds, open(i))
			}
			return fds
		}
	}
	udp := func(i int) int {
		var fd int
		err := netns.Do(pod, func() error {
			var err error
			if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
				return err
			}
			if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, testMark); err != nil {
				return err
			}
			return unix.Bind(fd, &unix.SockaddrInet4{Port: int(ports[i]) + 1000})
		})
		if err != nil {
			t.Fatal(err)
		}
		return fd
	}
	pipe := func(int) int {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		unix.Close(p[1])
		return p[0]
	}
	file := func(int) int {
		fd, err := unix.Open("/etc/hostname", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		return fd
	}
	dir := t.TempDir()
	unixListener := func(i int) int {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Bind(fd, &unix.SockaddrUnix{Name: filepath.Join(dir, fmt.Sprint(time.Now().UnixNano(), i))}); err != nil {
			t.Fatal(err)
		}
		if err := unix.Listen(fd, 1); err != nil {
			t.Fatal(err)
		}
		return fd
	}
	portsAnswer := `{"ports":[15001,15006,15008]}`
	cases := map[string]struct {
		send func() []int
		want string
	}{
		"a UDP socket":            {three(udp), "SO_TYPE is 2, want 1"},
		"a pipe":                  {three(pipe), "SO_TYPE: socket operation on non-socket"},
		"a file":                  {three(file), "SO_TYPE: socket operation on non-socket"},
		"a unix socket listening": {three(unixListener), "SO_MARK (the tunnel mark) is 0"},
		// 200 pipes' read ends, most of which the kernel drops.
		"200 descriptors (MSG_CTRUNC)": {func() []int {
			var fds []int
			for range 200 {
				fds = append(fds, pipe(0))
			}
			return fds
		}, "with more than 3 descriptors"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			sock, accepted := fakePredecessor(t, portsAnswer, c.send)
			pred := mustPredecessor(t, sock)
			log := newTestLog()
			tun := handoverTunnel(t, log, pred)
			_ = netns.Do(pod, func() error { return nil })
			<-accepted
			before := openFDs(t)
			if err := tun.ServePod(context.Background(), "pod-a", pod, []netip.Addr{handoverPod}); err != nil {
				t.Fatal(err)
			}
			if got := handoverCount(tun, handoverFailed); got != 1 {
				t.Errorf("failed = %v, want 1", got)
			}
			if !strings.Contains(log.String(), c.want) {
				t.Errorf("log lacks %q:\n%s", c.want, log.String())
			}
			if !tun.podServing("pod-a") {
				t.Error("the pod did not open listeners of its own")
			}
			checkFDsAdded(t, before, 4, "the pod's own listeners, its namespace")
		})
	}
}

// TestHandoverServerDropsSentDescriptors: a request that comes with
// descriptors (a client passing the agent sockets or files of its own) is
// answered as without them, and the agent holds none of them: they are
// never installed (the request is read without room for them), so a
// client cannot fill the agent's descriptor table.
func TestHandoverServerDropsSentDescriptors(t *testing.T) {
	tun := handoverTunnel(t, nil, nil)
	sock, _ := serveHandover(t, tun)
	c, err := net.Dial("unixpacket", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	before := openFDs(t)
	var fds []int
	for range 200 {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		fds = append(fds, fd)
	}
	if _, _, err := c.(*net.UnixConn).WriteMsgUnix([]byte(`{"netns":1}`), unix.UnixRights(fds...), nil); err != nil {
		t.Fatal(err)
	}
	closeFDs(fds)
	buf := make([]byte, 512)
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	n, err := c.Read(buf)
	if err != nil || !strings.Contains(string(buf[:n]), "no pod served") {
		t.Errorf("answer %q, %v; want no pod served", buf[:n], err)
	}
	checkFDsAdded(t, before, 0, "a request carrying 200")
}
