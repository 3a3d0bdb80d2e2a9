package cni_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/smallfile/smallfiletest"
	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/cni/cnitest"
)

var quiet = slog.New(slog.DiscardHandler)

func addEvent() cni.PodEvent {
	return cni.PodEvent{
		Command:      cni.CommandAdd,
		PodName:      "web-1",
		PodNamespace: "shop",
		PodUID:       "8d0f7f2c-1111-4c3b-9a55-3b1c2a7e0001",
		ContainerID:  "c0ffee",
		NetNS:        "/var/run/netns/cni-1234",
		IfName:       "eth0",
		IPs:          []netip.Prefix{netip.MustParsePrefix("10.244.1.5/24"), netip.MustParsePrefix("fd00:244:1::5/64")},
	}
}

func TestNotifyRoundTrip(t *testing.T) {
	sock := cnitest.SocketPath(t)
	agent := &cnitest.Agent{Answer: func(ev cni.PodEvent) (cni.Response, error) {
		return cni.Response{Enrolled: true, Reason: "namespace shop is ambient"}, nil
	}}
	cnitest.Serve(t, sock, agent)

	ev := addEvent()
	resp, err := cni.Notify(context.Background(), sock, ev)
	if err != nil {
		t.Fatalf("Notify: %v", err)
	}
	if want := (cni.Response{Enrolled: true, Reason: "namespace shop is ambient"}); resp != want {
		t.Errorf("response = %+v, want %+v", resp, want)
	}
	got := agent.Events()
	if len(got) != 1 || !reflect.DeepEqual(got[0], ev) {
		t.Errorf("agent received %+v, want exactly %+v", got, ev)
	}
}

func TestNotifyHandlerErrorBecomesResponseError(t *testing.T) {
	sock := cnitest.SocketPath(t)
	cnitest.Serve(t, sock, &cnitest.Agent{Answer: func(cni.PodEvent) (cni.Response, error) {
		return cni.Response{Reason: "namespace shop is ambient"}, errors.New("attach programs: no eth0")
	}})
	resp, err := cni.Notify(context.Background(), sock, addEvent())
	if err != nil {
		t.Fatalf("Notify: %v (an answer with an error is still an answer)", err)
	}
	if resp.Error != "attach programs: no eth0" || resp.Enrolled || resp.Reason != "namespace shop is ambient" {
		t.Errorf("response = %+v", resp)
	}
}

func TestServerRejectsInvalidEvents(t *testing.T) {
	sock := cnitest.SocketPath(t)
	agent := &cnitest.Agent{}
	cnitest.Serve(t, sock, agent)
	for name, mutate := range map[string]func(*cni.PodEvent){
		"no netns on ADD":   func(ev *cni.PodEvent) { ev.NetNS = "" },
		"no pod name":       func(ev *cni.PodEvent) { ev.PodName = "" },
		"no container id":   func(ev *cni.PodEvent) { ev.ContainerID = "" },
		"unknown command":   func(ev *cni.PodEvent) { ev.Command = "GC" },
		"no netns on CHECK": func(ev *cni.PodEvent) { ev.Command, ev.NetNS = cni.CommandCheck, "" },
	} {
		t.Run(name, func(t *testing.T) {
			ev := addEvent()
			mutate(&ev)
			resp, err := cni.Notify(context.Background(), sock, ev)
			if err != nil {
				t.Fatalf("Notify: %v", err)
			}
			if !strings.Contains(resp.Error, "invalid CNI event") {
				t.Errorf("response = %+v, want an invalid-event error", resp)
			}
		})
	}
	// DEL may come after the runtime destroyed the namespace.
	ev := addEvent()
	ev.Command, ev.NetNS = cni.CommandDel, ""
	if resp, err := cni.Notify(context.Background(), sock, ev); err != nil || resp.Error != "" {
		t.Errorf("DEL without netns: %+v, %v", resp, err)
	}
	if n := len(agent.Events()); n != 1 {
		t.Errorf("handler saw %d events, want only the valid DEL", n)
	}
}

func TestNotifyUnreachable(t *testing.T) {
	t.Run("no socket", func(t *testing.T) {
		sock := cnitest.SocketPath(t)
		_, err := cni.Notify(context.Background(), sock, addEvent())
		if !errors.Is(err, cni.ErrAgentUnreachable) {
			t.Fatalf("err = %v, want ErrAgentUnreachable", err)
		}
		if !strings.Contains(err.Error(), sock) {
			t.Errorf("error %q does not name the socket", err)
		}
	})
	t.Run("stale socket", func(t *testing.T) {
		sock := cnitest.SocketPath(t)
		staleSocket(t, sock)
		if _, err := cni.Notify(context.Background(), sock, addEvent()); !errors.Is(err, cni.ErrAgentUnreachable) {
			t.Fatalf("err = %v, want ErrAgentUnreachable", err)
		}
	})
}

// TestNotifyFullQueueIsNotUnreachable: an agent that does not accept (busy
// with its connection bound, or hung) is not an agent that is down. Its
// queue fills (a plugin that gave up leaves its connection queued) and
// connect fails with EAGAIN; that must fail the command, not send the
// plugin to the selection hint (seen failing: EAGAIN was taken for "no
// agent", and a pod the hint does not know as ambient, one opted in by its
// own label, would start unmeshed while the agent ran).
func TestNotifyFullQueueIsNotUnreachable(t *testing.T) {
	sock := cnitest.SocketPath(t)
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		t.Fatal(err)
	}
	// A listener that never accepts, with the shortest queue the kernel
	// keeps (one connection).
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: sock}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	var errs []error
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, err := cni.Notify(ctx, sock, addEvent())
		cancel()
		errs = append(errs, err)
	}
	for i, err := range errs {
		if err == nil || errors.Is(err, cni.ErrAgentUnreachable) {
			t.Errorf("Notify %d to an agent that does not accept: err = %v, want an error that is not ErrAgentUnreachable", i, err)
		}
	}
	if last := errs[len(errs)-1]; !errors.Is(last, syscall.EAGAIN) {
		t.Errorf("last error %v: want EAGAIN (a full queue)", last)
	}
}

// staleSocket leaves a socket file nobody listens on, as a killed agent does.
func staleSocket(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
}

func TestNotifyTimeoutIsNotUnreachable(t *testing.T) {
	sock := cnitest.SocketPath(t)
	handlerDone := make(chan error, 1)
	srv := cni.NewServer(sock, func(ctx context.Context, ev cni.PodEvent) (cni.Response, error) {
		<-ctx.Done() // a hung enrollment
		handlerDone <- ctx.Err()
		return cni.Response{}, ctx.Err()
	}, quiet)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go srv.Serve(ctx)
	<-srv.Ready()

	nctx, ncancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer ncancel()
	_, err := cni.Notify(nctx, sock, addEvent())
	if err == nil || errors.Is(err, cni.ErrAgentUnreachable) {
		t.Fatalf("err = %v, want a timeout that is not ErrAgentUnreachable", err)
	}
	select {
	case err := <-handlerDone:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("handler context ended with %v, want canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("handler context not canceled after the plugin gave up")
	}
}

func TestServeSocketLifecycle(t *testing.T) {
	sock := cnitest.SocketPath(t)
	staleSocket(t, sock)
	if err := os.Chmod(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	stop := cnitest.Serve(t, sock, &cnitest.Agent{})

	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode = %v, want a socket with 0600", fi.Mode())
	}
	if _, err := cni.Notify(context.Background(), sock, addEvent()); err != nil {
		t.Fatalf("Notify after replacing the stale socket: %v", err)
	}

	// A second agent (an upgrade) takes the path over atomically: every
	// Notify from then on reaches it, and the first one's stop leaves it.
	second := &cnitest.Agent{}
	stop2 := cnitest.Serve(t, sock, second)
	if _, err := cni.Notify(context.Background(), sock, addEvent()); err != nil {
		t.Fatalf("Notify after the hand-over: %v", err)
	}
	stop()
	if _, err := cni.Notify(context.Background(), sock, addEvent()); err != nil {
		t.Fatalf("Notify after the first agent stopped: %v (it removed its successor's socket)", err)
	}
	if n := len(second.Events()); n != 2 {
		t.Errorf("successor got %d events, want both sent after the hand-over", n)
	}
	stop = stop2

	stop()
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after stop: %v", err)
	}
	if _, err := cni.Notify(context.Background(), sock, addEvent()); !errors.Is(err, cni.ErrAgentUnreachable) {
		t.Errorf("Notify after stop: err = %v, want ErrAgentUnreachable", err)
	}
}

func TestServeCreatesPrivateDirectory(t *testing.T) {
	sock := cnitest.SocketPath(t) // its directory does not exist yet
	cnitest.Serve(t, sock, &cnitest.Agent{})
	fi, err := os.Stat(filepath.Dir(sock))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o700 {
		t.Errorf("socket directory mode = %v, want 0700", fi.Mode().Perm())
	}
}

func TestServeRefusesNonSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cni.sock")
	if err := os.WriteFile(path, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := cni.NewServer(path, (&cnitest.Agent{}).Handle, quiet).Serve(context.Background())
	if err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("err = %v, want not a socket", err)
	}
	if data, _ := os.ReadFile(path); string(data) != "precious" {
		t.Error("server clobbered a regular file at its socket path")
	}
}

// TestStartupHint: where no hint is (a node just rebooted: it lives on
// tmpfs), the agent's start writes one that knows only the excluded
// namespaces, so the plugin lets kube-system's pods (CoreDNS) start while
// the agent has not read its source; every other pod may be ambient and is
// refused. Before, there was no hint until the first snapshot, and every
// pod was refused. An existing hint, the last agent's word, is kept.
func TestStartupHint(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "ambient-namespaces.json")
	if err := cni.WriteStartupHint(path, []string{"kube-system"}); err != nil {
		t.Fatal(err)
	}
	h, err := cni.ReadSelectionHint(path)
	if err != nil {
		t.Fatal(err)
	}
	for ns, want := range map[string]bool{"kube-system": false, "default": true, "shop": true} {
		if got := h.WouldEnroll(ns); got != want {
			t.Errorf("start-up hint: WouldEnroll(%q) = %v, want %v", ns, got, want)
		}
	}
	if err := cni.WriteSelectionHint(path, []string{"shop"}, []string{"kube-system"}); err != nil {
		t.Fatal(err)
	}
	if err := cni.WriteStartupHint(path, []string{"kube-system"}); err != nil {
		t.Fatal(err)
	}
	if h, err := cni.ReadSelectionHint(path); err != nil || h.AmbientUnknown || h.WouldEnroll("default") {
		t.Errorf("an existing hint was replaced by the start-up one: %+v %v", h, err)
	}
}

func TestSelectionHint(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "ambient-namespaces.json")
	if _, err := cni.ReadSelectionHint(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing hint: err = %v, want ErrNotExist", err)
	}
	if err := cni.WriteSelectionHint(path, []string{"shop", "bank", "shop"}, []string{"kube-system", "shop-excluded"}); err != nil {
		t.Fatal(err)
	}
	// Replacing works and leaves no temporary files behind.
	if err := cni.WriteSelectionHint(path, []string{"shop", "bank", "shop", "kube-system"}, []string{"kube-system"}); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Errorf("hint directory holds %d entries, want only the hint", len(entries))
	}
	h, err := cni.ReadSelectionHint(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"bank", "kube-system", "shop"}; !reflect.DeepEqual(h.AmbientNamespaces, want) {
		t.Errorf("ambient = %v, want %v (sorted, unique)", h.AmbientNamespaces, want)
	}
	if time.Since(h.Written) > time.Minute {
		t.Errorf("written = %v", h.Written)
	}
	for ns, want := range map[string]bool{"shop": true, "bank": true, "kube-system": false, "default": false} {
		if got := h.WouldEnroll(ns); got != want {
			t.Errorf("WouldEnroll(%q) = %v, want %v", ns, got, want)
		}
	}
	if err := os.WriteFile(path, []byte("{not json"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := cni.ReadSelectionHint(path); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("corrupt hint: err = %v, want a decode error naming the file", err)
	}
	// A fifo at the path is refused at once, not waited on for a writer.
	fifo := smallfiletest.Fifo(t, filepath.Join(t.TempDir(), "fifo.json"))
	err = waitfor.Returns(t, "ReadSelectionHint(fifo)", func() error { _, err := cni.ReadSelectionHint(fifo); return err })
	if err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("fifo hint: err = %v, want not a regular file", err)
	}
}
