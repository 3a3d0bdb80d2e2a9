package hbone

import (
	"net"
	"net/netip"
	"sync"
)

// A connection's receive window is what its peer may send before we read it: bytes the agent
// holds for a stream whose application does not read. A large window lets one connection fill
// a fast link, but granted to every connection it would let one client (1024 connections per
// source address) make the agent hold 16 GiB. So the window beyond HTTP/2's initial 64 KiB is
// reserved from a process-wide budget when the connection starts, with a share per address
// that opens connections (windowOwnerOf), and given back when it closes. A connection that
// finds the budget spent gets what is left (at least the initial window): slower on a long
// path, never refused.
const (
	// maxReservedWindow bounds the receive window reserved by all connections together.
	maxReservedWindow = 1 << 30
	// maxPeerWindow bounds what the connections one address opened reserve: eight
	// connections' full windows, so one client cannot take the budget from the others.
	maxPeerWindow = 8 * (connWindow - defaultWindow)
)

// windowBudget is the process-wide receive-window budget.
type windowBudget struct {
	limit, perPeer int64

	mu       sync.Mutex
	reserved int64
	byPeer   map[netip.Addr]int64
	short    uint64 // reservations that got less than they asked for
}

func newWindowBudget(limit, perPeer int64) *windowBudget {
	return &windowBudget{limit: limit, perPeer: perPeer, byPeer: make(map[netip.Addr]int64)}
}

var windows = newWindowBudget(maxReservedWindow, maxPeerWindow)

// reserve takes up to want bytes of window for a connection with peer and
// returns what it took.
func (b *windowBudget) reserve(peer netip.Addr, want int64) int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := max(min(want, b.limit-b.reserved, b.perPeer-b.byPeer[peer]), 0)
	if n < want {
		b.short++
	}
	if n > 0 {
		b.reserved += n
		b.byPeer[peer] += n
	}
	return n
}

// release gives back n bytes reserved for a connection with peer.
func (b *windowBudget) release(peer netip.Addr, n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reserved -= n
	if left := b.byPeer[peer] - n; left > 0 {
		b.byPeer[peer] = left
	} else {
		delete(b.byPeer, peer)
	}
}

// windowOwnerOf is the address a connection's window is reserved under:
// whoever opened the connection, so whoever decides how many there are. On a
// server that is the client's address; on a client, the local pod's address
// it dials from (a destination many pods on this node talk to does not
// make them share one share). The zero address for a connection without
// one (a pipe).
func windowOwnerOf(nc net.Conn, client bool) netip.Addr {
	addr := nc.RemoteAddr()
	if client {
		addr = nc.LocalAddr()
	}
	if a, ok := addr.(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// WindowStats is the state of the receive-window budget.
type WindowStats struct {
	Reserved, Limit int64  // bytes beyond each connection's initial window
	Short           uint64 // connections that got less than a full window
}

// Windows reports the receive-window budget, for metrics.
func Windows() WindowStats {
	windows.mu.Lock()
	defer windows.mu.Unlock()
	return WindowStats{Reserved: windows.reserved, Limit: windows.limit, Short: windows.short}
}
