package netnstest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// HTTPApp serves "<name> peer=<client address>" on port inside the pod, so
// a caller sees which app answered and whom the app saw as its client. It
// stops in t.Cleanup, or earlier with Close.
func HTTPApp(t TB, p *Pod, port int, name string) *http.Server {
	t.Helper()
	l, err := netns.Listen(context.Background(), p.Path(), "tcp", fmt.Sprintf("[::]:%d", port), netns.SocketOptions{})
	if err != nil {
		t.Fatalf("app %s on %s: %v", name, p.Name, err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		a, _ := netip.ParseAddr(host)
		fmt.Fprintf(w, "%s peer=%s\n", name, a.Unmap())
	})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return srv
}

// Curl fetches url with curl from inside pod p (a real client, as a user
// would run it in the pod).
func Curl(p *Pod, url string) (string, error) {
	return CurlFrom(p.Path(), url)
}

// CurlFrom fetches url with curl from inside the network namespace at path.
func CurlFrom(path, url string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := Exec(ctx, path, "curl", "-sS", "-g", "--max-time", "5", url)
	return string(out), err
}

// URL is http://addr:port/.
func URL(a netip.Addr, port int) string {
	return "http://" + netip.AddrPortFrom(a, uint16(port)).String() + "/"
}

// ServeTCP accepts connections on port inside the pod and runs handle for
// each, closing the connection afterwards; it stops in t.Cleanup.
func ServeTCP(t TB, p *Pod, port int, handle func(net.Conn)) {
	t.Helper()
	l, err := netns.Listen(context.Background(), p.Path(), "tcp", fmt.Sprintf("[::]:%d", port), netns.SocketOptions{})
	if err != nil {
		t.Fatalf("listen on %s:%d: %v", p.Name, port, err)
	}
	ServeConns(t, l, handle)
}

// ServeConns runs handle for each connection l accepts, closing the
// connection afterwards, until l is closed (in t.Cleanup).
func ServeConns(t TB, l net.Listener, handle func(net.Conn)) {
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c)
			}()
		}
	}()
}

// WaitRefused waits until a request from p to url fails, as it does once
// the agents applied a policy that refuses it.
func WaitRefused(t TB, p *Pod, url string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		out, err := Curl(p, url)
		if err != nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s from %s still answered after %s: %q", url, p.Name, timeout, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
