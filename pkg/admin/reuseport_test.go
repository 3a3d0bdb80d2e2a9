package admin

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"testing"
)

// TestEndpointsCannotBeJoined: the metrics, readiness and admin endpoints
// listen in the node's namespace. With SO_REUSEPORT on them (so that an
// upgrading agent could bind beside its predecessor), any other process of
// the same user joined the port: a hostNetwork container running as root
// bound it with SO_REUSEPORT and took a share of kubelet's probes (or all
// of them on the node's own address, which a specific bind wins over the
// wildcard), answering ready for an agent that was not, or not ready for
// one that was; a share of the scrapes and of istioctl's admin calls too.
// Started without a predecessor's sockets, the endpoints take their ports
// alone: another bind fails, with SO_REUSEPORT or without.
func TestEndpointsCannotBeJoined(t *testing.T) {
	s, err := Start(context.Background(), Options{
		ReadinessAddr: "127.0.0.1:0", Ready: func() (bool, string) { return true, "" },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, shared := range []bool{true, false} {
		lc := net.ListenConfig{}
		if shared {
			lc.Control = reusePort
		}
		l, err := lc.Listen(context.Background(), "tcp", s.ReadinessAddr())
		if err == nil {
			l.Close()
			t.Errorf("another socket (SO_REUSEPORT %v) bound the readiness endpoint's %s beside it", shared, s.ReadinessAddr())
		}
	}
}

// TestOwnPortsAfterSharedStart: beside a predecessor that does not hand
// its endpoints over, the agent binds with SO_REUSEPORT (ListenShared);
// once the predecessor is gone, OwnPorts binds each such endpoint alone,
// and from then no socket can join while the endpoint serves on.
func TestOwnPortsAfterSharedStart(t *testing.T) {
	ctx := context.Background()
	s, err := Start(ctx, Options{
		ReadinessAddr: "127.0.0.1:0", Ready: func() (bool, string) { return true, "" },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Listen: func(ctx context.Context, _, addr string) (net.Listener, error) { return ListenShared(ctx, addr) },
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	addr := s.ReadinessAddr()
	pred, err := ListenShared(ctx, addr)
	if err != nil {
		t.Fatalf("a shared bind beside the shared endpoint: %v", err)
	}
	pred.Close() // the predecessor goes
	if err := s.OwnPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if j, err := ListenShared(ctx, addr); err == nil {
		j.Close()
		t.Fatal("a socket with SO_REUSEPORT joined the readiness port after OwnPorts")
	}
	for i := range 3 {
		resp, err := http.Get("http://" + addr + "/healthz/ready")
		if err != nil {
			t.Fatalf("probe %d after OwnPorts: %v", i, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("probe %d after OwnPorts: %s", i, resp.Status)
		}
	}
}
