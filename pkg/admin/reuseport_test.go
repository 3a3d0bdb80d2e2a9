package admin

import (
	"context"
	"io"
	"log/slog"
	"net"
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
