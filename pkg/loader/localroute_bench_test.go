package loader_test

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// BenchmarkCapturedRoundTrip times a 1-byte request and reply between an
// app and the tunnel's outbound listener in the same pod (the listener's
// socket echoes), over each capture path: what the capture costs one round
// trip, without a relay or a wire behind it.
func BenchmarkCapturedRoundTrip(b *testing.B) {
	for _, path := range capturePaths {
		b.Run(path.name, func(b *testing.B) {
			app := capturedConn(b, path, func(c net.Conn) { io.Copy(c, c) })
			buf := []byte{1}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := app.Write(buf); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(app, buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkCapturedStream moves 64 KiB writes of an app into the tunnel's
// outbound listener in the same pod (which discards them), over each
// capture path.
func BenchmarkCapturedStream(b *testing.B) {
	for _, path := range capturePaths {
		b.Run(path.name, func(b *testing.B) {
			app := capturedConn(b, path, func(c net.Conn) { io.Copy(io.Discard, c) })
			buf := make([]byte, 64<<10)
			b.SetBytes(int64(len(buf)))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := app.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// capturedConn is an app's captured connection in a fresh simulated pod,
// served by serve on the tunnel's outbound listener there.
func capturedConn(b *testing.B, path capturePath, serve func(net.Conn)) net.Conn {
	topo := netnstest.New(b, 1)
	node := topo.Nodes[0]
	client, other := node.AddPod("client"), node.AddPod("other")
	root := loadertest.TempBPFFS(b)
	l := loadertest.LoadPacketPath(b, root, !path.local)
	b.Cleanup(func() { l.Close() })
	ctx := context.Background()
	if _, err := l.AttachPod(ctx, loadertest.PodOf(client, true)); err != nil {
		b.Fatal(err)
	}
	tunnel, err := netns.Listen(ctx, client.Path(), "tcp", "[::]:15001", netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { tunnel.Close() })
	go func() {
		c, err := tunnel.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		serve(c)
	}()
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	app, err := netns.Dial(dctx, client.Path(), "tcp", ap(other.IPv4, 8080).String(), netns.SocketOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { app.Close() })
	return app
}
