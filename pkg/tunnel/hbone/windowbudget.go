package hbone

import (
	"math"
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
// path, never refused. Unless idle connections hold it: a connection that would come up short
// may reclaim the window of an idle connection (no streams) of the address holding the most,
// which is drained (reclaim), the way ConnLimiter evicts for connection slots. Otherwise a few
// addresses' idle connections, renewed before the idle timeout, would hold the whole budget and
// leave every later connection of the node at the initial window.
const (
	// maxReservedWindow bounds the receive window reserved by all connections together.
	maxReservedWindow = 1 << 30
	// maxPeerWindow bounds what the connections one address opened reserve: eight
	// connections' full windows, so one client cannot take the budget from the others.
	maxPeerWindow = 8 * (connWindow - defaultWindow)
	// maxRemoteWindow bounds what one source's client connections to one server
	// reserve: half the source's share. The server decides how many connections
	// its streams take (SETTINGS_MAX_CONCURRENT_STREAMS 1: one each), and without
	// it a server holding eight streams open spent the source's whole share, so
	// every later connection of the source, to any server, got the initial
	// window for its life.
	maxRemoteWindow = maxPeerWindow / 2
)

// windowBudget is the process-wide receive-window budget.
type windowBudget struct {
	limit, perPeer int64
	// perRemote bounds what one owner's client connections to one server
	// reserve (0: no bound); server connections have no such bound.
	perRemote int64

	mu       sync.Mutex
	reserved int64
	byPeer   map[netip.Addr]int64
	byPair   map[windowPair]int64 // client connections: by owner and server
	// holders are the connections holding each address's reservations,
	// for reclaim.
	holders   map[netip.Addr]map[windowHolder]struct{}
	short     uint64 // reservations that got less than they asked for
	reclaimed uint64 // idle connections drained to give their window to another address
}

// windowHolder is a connection holding a reservation.
type windowHolder interface {
	// giveBackIfIdle, if the connection has no streams, stops it taking
	// new ones, releases its reservation at once and drains it; it
	// reports whether it did.
	giveBackIfIdle() bool
}

// maxReclaimLooks bounds the connections one reclaim asks: the largest
// holder may hold a thousand, all busy.
const maxReclaimLooks = 64

func newWindowBudget(limit, perPeer int64) *windowBudget {
	return &windowBudget{limit: limit, perPeer: perPeer, byPeer: make(map[netip.Addr]int64), byPair: make(map[windowPair]int64),
		holders: make(map[netip.Addr]map[windowHolder]struct{})}
}

// reserveFor is reserve for connection h, which is tracked as a holder
// until untrack: short on the node-wide budget, it first tries to reclaim
// the window of an idle connection of the largest holder.
func (b *windowBudget) reserveFor(peer, remote netip.Addr, want int64, h windowHolder) int64 {
	b.mu.Lock()
	n := b.takeLocked(peer, remote, want)
	b.mu.Unlock()
	if n < want && b.reclaim(peer, remote, want) {
		b.mu.Lock()
		n += b.takeLocked(peer, remote, want-n)
		b.mu.Unlock()
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if n < want {
		b.short++
	}
	if n > 0 {
		hs := b.holders[peer]
		if hs == nil {
			hs = make(map[windowHolder]struct{})
			b.holders[peer] = hs
		}
		hs[h] = struct{}{}
	}
	return n
}

// untrack forgets h, which released its reservation.
func (b *windowBudget) untrack(peer netip.Addr, h windowHolder) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if hs := b.holders[peer]; hs != nil {
		delete(hs, h)
		if len(hs) == 0 {
			delete(b.holders, peer)
		}
	}
}

// reclaim drains an idle connection of the address holding the most, so
// that want more fits the node-wide budget for peer. Only from an address
// holding at least two windows more than peer: after giving one, it still
// holds more, so addresses converge on equal shares and never take turns
// draining each other. Not when peer's own share is what is short.
func (b *windowBudget) reclaim(peer, remote netip.Addr, want int64) bool {
	b.mu.Lock()
	if b.perPeer-b.byPeer[peer] < want || b.pairRoomLocked(peer, remote) < want {
		b.mu.Unlock()
		return false
	}
	var most netip.Addr
	var mostHeld int64
	for p, held := range b.byPeer {
		if p != peer && held > mostHeld {
			most, mostHeld = p, held
		}
	}
	var candidates []windowHolder
	if mostHeld >= b.byPeer[peer]+2*want {
		for h := range b.holders[most] {
			if len(candidates) == maxReclaimLooks {
				break
			}
			candidates = append(candidates, h)
		}
	}
	b.mu.Unlock()
	for _, h := range candidates {
		if h.giveBackIfIdle() {
			b.mu.Lock()
			b.reclaimed++
			b.mu.Unlock()
			return true
		}
	}
	return false
}

var windows = func() *windowBudget {
	b := newWindowBudget(maxReservedWindow, maxPeerWindow)
	b.perRemote = maxRemoteWindow
	return b
}()

// reserve takes up to want bytes of window for a connection with peer and
// returns what it took.
func (b *windowBudget) reserve(peer netip.Addr, want int64) int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.takeLocked(peer, netip.Addr{}, want)
	if n < want {
		b.short++
	}
	return n
}

// windowPair is a client connection's owner (the source) and server.
type windowPair struct{ owner, remote netip.Addr }

// pairRoomLocked is what owner's client connections to remote may still
// reserve; remote is the zero address for a server connection, unbounded.
func (b *windowBudget) pairRoomLocked(owner, remote netip.Addr) int64 {
	if b.perRemote == 0 || !remote.IsValid() {
		return math.MaxInt64
	}
	return b.perRemote - b.byPair[windowPair{owner, remote}]
}

// takeLocked takes up to want bytes for peer (and, for a client
// connection, its server remote), uncounted.
func (b *windowBudget) takeLocked(peer, remote netip.Addr, want int64) int64 {
	n := max(min(want, b.limit-b.reserved, b.perPeer-b.byPeer[peer], b.pairRoomLocked(peer, remote)), 0)
	if n > 0 {
		b.reserved += n
		b.byPeer[peer] += n
		if b.perRemote != 0 && remote.IsValid() {
			b.byPair[windowPair{peer, remote}] += n
		}
	}
	return n
}

// release gives back n bytes reserved for a connection with peer (and
// remote, as reserved).
func (b *windowBudget) release(peer, remote netip.Addr, n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if pair := (windowPair{peer, remote}); b.byPair[pair] > 0 {
		if left := b.byPair[pair] - n; left > 0 {
			b.byPair[pair] = left
		} else {
			delete(b.byPair, pair)
		}
	}
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
	Reclaimed       uint64 // idle connections drained for another address's window
}

// Windows reports the receive-window budget, for metrics.
func Windows() WindowStats {
	windows.mu.Lock()
	defer windows.mu.Unlock()
	return WindowStats{Reserved: windows.reserved, Limit: windows.limit, Short: windows.short, Reclaimed: windows.reclaimed}
}
