package hbone

import (
	"crypto/tls"
	"sync"
)

// trustChanges closes the gap between a handshake's verification and its
// connection's registration. DrainPeers rechecks the registered
// connections when the trust bundle changed; a handshake verified against
// the old roots but registered after that pass would be missed, and serve
// its peer until its leaf expires (a client or server can hold back its
// last handshake flight for the handshake timeout to aim at that moment).
// So a connection notes the generation before its handshake, and once
// registered, if a change came since, it is checked with the latest one.
type trustChanges struct {
	mu   sync.Mutex
	gen  uint64
	keep func(tls.ConnectionState) bool
}

// generation is the count of changes so far; read it before a handshake.
func (t *trustChanges) generation() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.gen
}

// changed records a change, and keep as the check it brings; call it before
// going through the registered connections.
func (t *trustChanges) changed(keep func(tls.ConnectionState) bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.gen++
	t.keep = keep
}

// recheck drains c, registered now, if a change came since gen and its
// check refuses c's peer as its handshake presented it.
func (t *trustChanges) recheck(gen uint64, c *conn) {
	t.mu.Lock()
	keep := t.keep
	changed := t.gen != gen
	t.mu.Unlock()
	if changed && keep != nil && c.tlsState != nil && !keep(*c.tlsState) {
		c.drain()
	}
}
