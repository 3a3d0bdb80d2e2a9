// Package hbone speaks HBONE, the tunnel protocol of Istio ambient: HTTP/2
// CONNECT over mutual TLS 1.3 (ALPN "h2"), normally on port 15008. Each
// CONNECT stream carries one proxied TCP connection; many streams share one
// TLS connection.
//
// The package has three parts:
//
//   - Pool, the client: it keeps one or more TLS connections per PoolKey and
//     opens streams on them (Pool.Connect).
//   - Server, the listener side: it validates each CONNECT, asks the caller's
//     Handler what to do with it and relays bytes to the upstream the handler
//     dialled.
//   - Relay, a bidirectional copy with half-close that both paths use.
//
// The HTTP/2 layer is a small implementation of just what CONNECT tunnels
// need (RFC 9113 framing, flow control, GOAWAY, RST_STREAM) on top of the
// frame codec and HPACK of golang.org/x/net/http2. It does not use
// http2.Transport or http2.Server: their request/response plumbing costs
// several goroutine hand-offs and copies per DATA frame, which made a naive
// Go HBONE pair reach a tenth of direct throughput (design §10). Here a
// stream's Write frames and encrypts on the caller's goroutine, one reader
// goroutine per connection demultiplexes DATA into per-stream buffers, and
// Relay moves bytes between a stream and a socket without extra copies.
//
// The package knows nothing about eBPF, network namespaces, SPIFFE or policy:
// the caller injects the dialer, the tls.Configs and the Handler.
package hbone
