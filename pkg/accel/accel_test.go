package accel

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
)

// TestKeyOf: the agent's key for a socket must be the one rd_sockops
// computes, or reads return no budget: IPv4-mapped addresses, ports in
// network byte order, the namespace cookie; and swapped gives the peer's.
func TestKeyOf(t *testing.T) {
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp4", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ck, err := keyOf(c.(*net.TCPConn))
	if err != nil {
		t.Fatal(err)
	}
	sk, err := keyOf(s.(*net.TCPConn))
	if err != nil {
		t.Fatal(err)
	}
	if want := netip.MustParseAddr("::ffff:127.0.0.1").As16(); ck.Local != want || ck.Remote != want {
		t.Errorf("addresses %x %x, want IPv4-mapped 127.0.0.1", ck.Local, ck.Remote)
	}
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], ck.Rport)
	if binary.BigEndian.Uint16(b[:]) != port {
		t.Errorf("remote port field %#04x does not hold %d in network order", ck.Rport, port)
	}
	if ck.Netns == 0 {
		t.Error("no network namespace cookie")
	}
	if swapped(ck) != sk {
		t.Errorf("the client's key swapped is %+v, the server's is %+v", swapped(ck), sk)
	}
}
