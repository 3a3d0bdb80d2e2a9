package netnstest

import (
	"log/slog"
	"path/filepath"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/tunnel"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// FileCATunnel is a tunnel on the default ports with a fresh file CA
// (trust domain cluster.local) and its certificate manager, for tests that
// drive the reconciler or node agent in-process, without an agent binary.
func FileCATunnel(t TB, log *slog.Logger) (*tunnel.Tunnel, *identity.Manager) {
	t.Helper()
	caDir := filepath.Join(t.TempDir(), "ca")
	if err := identity.InitCA(caDir, "cluster.local"); err != nil {
		t.Fatalf("file CA: %v", err)
	}
	ca, err := identity.LoadCA(caDir)
	if err != nil {
		t.Fatalf("file CA: %v", err)
	}
	s := loader.DefaultSettings()
	certs := identity.NewManager(ca, time.Hour, time.Now)
	tun := tunnel.New(tunnel.Config{TrustDomain: "cluster.local", OutboundPort: s.OutboundPort, InboundPort: s.InboundPort, HBONEPort: s.HBONEPort,
		TunnelMark: s.TunnelMark, Certs: certs, Pool: hbone.NewPool(hbone.PoolOptions{}), Logger: log})
	return tun, certs
}
