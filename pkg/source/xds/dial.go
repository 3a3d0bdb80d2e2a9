package xds

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/keepalive"

	"github.com/redirector-mesh/redirector/internal/smallfile"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/istioca"
)

// Dial returns a connection to istiod's xDS port verified the way the CA
// client verifies istiod (istioca.Credentials): its serving certificate
// must chain to the mesh roots, read at each handshake, and carry
// serverName (empty: the address's host, or istioca.DefaultServerName for
// an IP); when the roots change, a connection whose istiod no longer
// verifies is closed and the stream reconnects. It connects lazily.
func Dial(addr, serverName string, trust identity.Trust) (*grpc.ClientConn, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("istiod xds address %q: want host:port: %w", addr, err)
	}
	if trust == nil {
		return nil, errors.New("istiod xds: no trust bundle to verify istiod with")
	}
	if serverName == "" {
		serverName = host
		if net.ParseIP(host) != nil {
			serverName = istioca.DefaultServerName
		}
	}
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(istioca.Credentials(trust, serverName, nil)),
		grpc.WithKeepaliveParams(keepaliveParams),
		grpc.WithMaxHeaderListSize(maxHeaderBytes),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 500 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 10 * time.Second},
			MinConnectTimeout: 5 * time.Second,
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("istiod xds client for %s: %w", addr, err)
	}
	return conn, nil
}

// keepaliveParams: istiod sends nothing while nothing changes, so a
// connection whose far end is gone while something between keeps the TCP
// side open (a proxy or load balancer in front of istiod) looked like a
// quiet istiod for ever: the last state never updated, the stream counted
// as connected, no reconnect. An HTTP/2 PING after 30 s without traffic,
// unanswered for 10 s, closes the connection, and Run reconnects (istiod
// refuses PINGs more often than every 15 s, and any while no stream is
// open, hence no PermitWithoutStream).
var keepaliveParams = keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}

// maxHeaderBytes bounds the headers and trailers istiod may send (gRPC's
// default is 16 MiB): the error a stream ends with is logged at every
// reconnect. istiod's are a few hundred bytes.
const maxHeaderBytes = 64 << 10

// TokenFile returns a Token function that re-reads path, since the kubelet
// rotates projected tokens.
func TokenFile(path string) func() (string, error) {
	return func() (string, error) {
		b, err := smallfile.Read(path, istioca.MaxTokenBytes)
		if err != nil {
			return "", fmt.Errorf("read token: %w", err)
		}
		tok := strings.TrimSpace(string(b))
		if tok == "" {
			return "", fmt.Errorf("token file %s is empty", path)
		}
		return tok, nil
	}
}
