package cni_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/cni/cnitest"
)

// serve runs a server with the given bounds and handler until the test ends.
func serve(t *testing.T, sock string, h cni.Handler, readTimeout time.Duration, maxConns int) *cni.Server {
	t.Helper()
	srv := cni.NewServer(sock, h, quiet)
	cni.SetLimits(srv, readTimeout, maxConns)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-srv.Ready():
	case err := <-done:
		t.Fatal(err)
	}
	return srv
}

// TestServerRefusesOtherUsers: a process that is not root (nor the agent's
// user) gets no answer and its event never reaches the handler, even when
// the socket's mode would let it connect: the mode is set after bind (a
// connection made in between stays open), and a directory mounted with
// other modes must not widen who may enroll pods (seen failing: the
// event of uid 65534 was handled).
func TestServerRefusesOtherUsers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a client as another user")
	}
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Skip("needs curl")
	}
	sock := cnitest.SocketPath(t)
	var mu sync.Mutex
	var handled []cni.PodEvent
	srv := serve(t, sock, func(_ context.Context, ev cni.PodEvent) (cni.Response, error) {
		mu.Lock()
		defer mu.Unlock()
		handled = append(handled, ev)
		return cni.Response{}, nil
	}, 10*time.Second, 16)
	for d := sock; d != "/tmp"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o777); err != nil {
			t.Fatal(err)
		}
	}
	body, _ := json.Marshal(addEvent())
	cmd := exec.Command(curl, "-sS", "--max-time", "5", "--unix-socket", sock, "-d", string(body), "http://agent"+cni.EventPath)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	t.Logf("curl as uid 65534: %v: %s", err, out)
	mu.Lock()
	if len(handled) > 0 {
		t.Errorf("an event from uid 65534 was handled: %+v", handled)
	}
	mu.Unlock()
	if err == nil {
		t.Errorf("uid 65534 got an answer: %s", out)
	}
	if st := srv.Stats(); st.RefusedPeers != 1 {
		t.Errorf("stats %+v, want 1 refused peer", st)
	}
	// Root still gets through.
	if _, err := cni.Notify(context.Background(), sock, addEvent()); err != nil {
		t.Errorf("root's Notify: %v", err)
	}
}

// TestServerBoundsSlowClients: a client that sends its headers and then
// stalls in the body is cut off after the read timeout (seen failing: only
// the headers had a timeout, so it held its connection and goroutine for
// ever), and at most maxConns connections are served at once; the next
// waits (and is counted) until one ends, then is served.
func TestServerBoundsSlowClients(t *testing.T) {
	sock := cnitest.SocketPath(t)
	release := make(chan struct{})
	var mu sync.Mutex
	inHandler := 0
	srv := serve(t, sock, func(ctx context.Context, ev cni.PodEvent) (cni.Response, error) {
		mu.Lock()
		inHandler++
		mu.Unlock()
		select {
		case <-release:
		case <-ctx.Done():
		}
		return cni.Response{}, nil
	}, 300*time.Millisecond, 2)

	// A stalled body.
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"command\":", cni.EventPath)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	_, _ = io.ReadAll(c)
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("a stalled body held its connection for %s, want it cut after the read timeout", d)
	}

	// Two events held in the handler; a third waits for a slot.
	errs := make(chan error, 3)
	for range 3 {
		go func() {
			_, err := cni.Notify(context.Background(), sock, addEvent())
			errs <- err
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		mu.Lock()
		n := inHandler
		mu.Unlock()
		if n >= 2 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	mu.Lock()
	n := inHandler
	mu.Unlock()
	if n != 2 {
		t.Errorf("%d events in the handler at once, want the bound 2", n)
	}
	if st := srv.Stats(); st.Open != 2 || st.Waited == 0 {
		t.Errorf("stats %+v, want 2 open and a connection that waited", st)
	}
	close(release)
	for range 3 {
		if err := <-errs; err != nil {
			t.Errorf("Notify: %v", err)
		}
	}
	if !strings.Contains(fmt.Sprint(srv.Stats()), "Open:0") {
		t.Logf("stats after: %+v", srv.Stats())
	}
}

// TestValidateNamesTheField: an event with a value no runtime sends (a pod
// name with a slash or a megabyte long, a UID or container id with path
// characters, a NUL in the namespace path, an interface name the kernel
// would not take) is refused before the handler sees it, with an error
// naming the CNI variable (seen failing: each was handed to the agent,
// which keyed its records by the name and kept them for the sandbox's
// life).
func TestValidateNamesTheField(t *testing.T) {
	for _, tc := range []struct {
		field string
		edit  func(*cni.PodEvent)
	}{
		{"K8S_POD_NAME", func(e *cni.PodEvent) { e.PodName = "a/b" }},
		{"K8S_POD_NAME", func(e *cni.PodEvent) { e.PodName = strings.Repeat("a", 1<<20) }},
		{"K8S_POD_NAMESPACE", func(e *cni.PodEvent) { e.PodNamespace = "shop/web-1" }},
		{"K8S_POD_NAMESPACE", func(e *cni.PodEvent) { e.PodNamespace = "Shop" }},
		{"K8S_POD_UID", func(e *cni.PodEvent) { e.PodUID = "../uid" }},
		{"K8S_POD_UID", func(e *cni.PodEvent) { e.PodUID = strings.Repeat("u", 129) }},
		{"CNI_CONTAINERID", func(e *cni.PodEvent) { e.ContainerID = "c0ffee/x" }},
		{"CNI_NETNS", func(e *cni.PodEvent) { e.NetNS = "/var/run/netns/x\x00y" }},
		{"CNI_IFNAME", func(e *cni.PodEvent) { e.IfName = "eth0123456789abc" }},
		{"CNI_IFNAME", func(e *cni.PodEvent) { e.IfName = "../eth0" }},
		{"CNI_IFNAME", func(e *cni.PodEvent) { e.IfName = "eth%d" }},
	} {
		ev := addEvent()
		tc.edit(&ev)
		err := ev.Validate()
		if err == nil {
			t.Errorf("%s: event %.100v passed", tc.field, ev)
			continue
		}
		if !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: error %q does not name the field", tc.field, err)
		}
		if len(err.Error()) > 1000 {
			t.Errorf("%s: error of %d bytes", tc.field, len(err.Error()))
		}
	}
	// A DEL needs neither namespace nor interface, and must not be refused
	// for them.
	del := addEvent()
	del.Command, del.NetNS, del.IfName = cni.CommandDel, "", "eth%d"
	if err := del.Validate(); err != nil {
		t.Errorf("DEL: %v", err)
	}
	if err := addEvent().Validate(); err != nil {
		t.Errorf("a good event: %v", err)
	}
	// The server refuses such an event without calling the handler.
	sock := cnitest.SocketPath(t)
	var calls int
	var mu sync.Mutex
	srv := serve(t, sock, func(context.Context, cni.PodEvent) (cni.Response, error) {
		mu.Lock()
		calls++
		mu.Unlock()
		return cni.Response{}, nil
	}, 10*time.Second, 16)
	bad := addEvent()
	bad.PodName = "a/b"
	resp, err := cni.Notify(context.Background(), sock, bad)
	if err != nil || !strings.Contains(resp.Error, "K8S_POD_NAME") {
		t.Errorf("Notify with a bad name: %+v, %v; want an error naming K8S_POD_NAME", resp, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls != 0 {
		t.Errorf("the handler was called %d times", calls)
	}
	if n := srv.Stats().Invalid; n != 1 {
		t.Errorf("invalid events counted: %d, want 1", n)
	}
}

// listenAs opens a unix listener at sock as if a process of uid had: the
// listener's SO_PEERCRED is the euid of the thread that called listen, so
// only this locked thread takes uid on for the call.
func listenAs(t *testing.T, sock string, uid int) net.Listener {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(sock), 0o777); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{filepath.Dir(sock), filepath.Dir(filepath.Dir(sock))} {
		if err := os.Chmod(d, 0o777); err != nil {
			t.Fatal(err)
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESUID, ^uintptr(0), uintptr(uid), ^uintptr(0)); e != 0 {
		t.Fatalf("setresuid: %v", e)
	}
	l, err := net.Listen("unix", sock)
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESUID, ^uintptr(0), 0, ^uintptr(0)); e != 0 {
		panic("cannot return to uid 0: " + e.Error())
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// TestNotifyRefusesSocketOfOtherUser: a socket at the agent's path served by
// a process that is neither root nor the plugin's user (one that could
// write to the socket's directory) is not taken for the agent: its
// "enrolled" is refused with an error naming the uid, and not as
// ErrAgentUnreachable, so the plugin does not fall back to the hint either
// (seen failing: the impostor's answer was returned, and a pod would have
// started unmeshed).
func TestNotifyRefusesSocketOfOtherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to listen as another user")
	}
	sock := cnitest.SocketPath(t)
	l := listenAs(t, sock, 65534)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				buf := make([]byte, 4096)
				_, _ = c.Read(buf)
				body := `{"enrolled":true,"reason":"impostor"}`
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
			}()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cni.Notify(ctx, sock, addEvent())
	t.Logf("Notify to a socket of uid 65534: %+v, %v", resp, err)
	if err == nil {
		t.Fatalf("the answer of a socket served by uid 65534 was taken: %+v", resp)
	}
	if errors.Is(err, cni.ErrAgentUnreachable) {
		t.Errorf("error %v is ErrAgentUnreachable: the plugin would fall back to the hint", err)
	}
	if !strings.Contains(err.Error(), "65534") {
		t.Errorf("error %q does not name the uid", err)
	}
}

// TestReadSelectionHintRefusesForeignFile: a hint owned by another user, or
// that group or others may write, is not read (seen failing: both were
// taken, so whoever could write there could say no namespace is ambient and
// have pods start unmeshed while the agent is down); the agent's own still
// is.
func TestReadSelectionHintRefusesForeignFile(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown")
	}
	path := filepath.Join(t.TempDir(), "hint.json")
	if err := cni.WriteSelectionHint(path, []string{"shop"}, nil); err != nil {
		t.Fatal(err)
	}
	if h, err := cni.ReadSelectionHint(path); err != nil || !h.WouldEnroll("shop") {
		t.Fatalf("the agent's own hint: %+v, %v", h, err)
	}
	if err := os.Chmod(path, 0o666); err != nil {
		t.Fatal(err)
	}
	if h, err := cni.ReadSelectionHint(path); err == nil || !strings.Contains(err.Error(), "writable") {
		t.Errorf("a world-writable hint: %+v, %v; want refused", h, err)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(path, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if h, err := cni.ReadSelectionHint(path); err == nil || !strings.Contains(err.Error(), "65534") {
		t.Errorf("a hint owned by uid 65534: %+v, %v; want refused naming the owner", h, err)
	}
}

// TestReadSelectionHintRefusesSymlinkAndLooseDir: the hint is read only
// where the agent writes it: a regular file at the path, in a directory no
// one else may write. The agent refuses to serve a socket in a directory
// group or others may write, and the plugin then reads the hint from that
// very directory (seen failing: a symlink there to any root-owned JSON file,
// a conflist, or a hard link to one, was read as a hint naming no ambient
// namespace, and every pod would have started unmeshed; a hint in a
// world-writable directory was read too).
func TestReadSelectionHintRefusesSymlinkAndLooseDir(t *testing.T) {
	dir := t.TempDir()
	conflist := filepath.Join(dir, "10-bridge.conflist")
	if err := os.WriteFile(conflist, []byte(`{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"bridge"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	hintDir := filepath.Join(dir, "redirector")
	if err := os.Mkdir(hintDir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(hintDir, "ambient-namespaces.json")
	if err := os.Symlink(conflist, path); err != nil {
		t.Fatal(err)
	}
	if h, err := cni.ReadSelectionHint(path); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Errorf("a symlink to a conflist: %+v, %v; want refused as a symlink", h, err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	// Nor is any other JSON object the hint's owner could have put there.
	if err := os.Link(conflist, path); err != nil {
		t.Fatal(err)
	}
	if h, err := cni.ReadSelectionHint(path); err == nil || !strings.Contains(err.Error(), "not a hint") {
		t.Errorf("a conflist at the hint's path: %+v, %v; want refused as not a hint", h, err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := cni.WriteSelectionHint(path, []string{"shop"}, nil); err != nil {
		t.Fatal(err)
	}
	if h, err := cni.ReadSelectionHint(path); err != nil || !h.WouldEnroll("shop") {
		t.Fatalf("the agent's own hint: %+v, %v", h, err)
	}
	if err := os.Chmod(hintDir, 0o777); err != nil {
		t.Fatal(err)
	}
	if h, err := cni.ReadSelectionHint(path); err == nil || !strings.Contains(err.Error(), "writable by group or others") || !strings.Contains(err.Error(), hintDir) {
		t.Errorf("a hint in a world-writable directory: %+v, %v; want refused naming the directory", h, err)
	}
}

// TestServeRefusesLooseSocketDir: the server does not listen in a directory
// that group or others may write, or that another user owns, and says which
// and why (seen failing: it served there, where anyone could rename a socket
// of their own over the agent's).
func TestServeRefusesLooseSocketDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown")
	}
	for _, tc := range []struct {
		name string
		prep func(dir string) error
		want string
	}{
		{"world-writable", func(dir string) error { return os.Chmod(dir, 0o777) }, "writable by group or others"},
		{"group-writable", func(dir string) error { return os.Chmod(dir, 0o770) }, "writable by group or others"},
		{"another user's", func(dir string) error { return os.Chown(dir, 65534, 65534) }, "owned by uid 65534"},
	} {
		sock := cnitest.SocketPath(t)
		dir := filepath.Dir(sock)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := tc.prep(dir); err != nil {
			t.Fatal(err)
		}
		srv := cni.NewServer(sock, func(context.Context, cni.PodEvent) (cni.Response, error) { return cni.Response{}, nil }, quiet)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := srv.Serve(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), dir) {
			t.Errorf("%s directory: Serve = %v; want an error naming %s and saying %q", tc.name, err, dir, tc.want)
		}
	}
}
