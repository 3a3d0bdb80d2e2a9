package tunnel

import (
	"fmt"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ListenerDrops counts what the kernel dropped at the pods' sockets before
// the agent read it, by socket: SYNs and handshakes a listener's full SYN
// or accept queue turned away (the namespace's ListenOverflows and
// ListenDrops), and datagrams a full DNS socket's receive queue turned
// away. The kernel counts them per socket (sk_drops, read with
// SO_MEMINFO); the sums only grow, as a pod that stops adds its final
// counts to the tunnel's retired ones.
type ListenerDrops struct {
	Outbound, Inbound, HBONE, DNS uint64
}

func (d *ListenerDrops) add(o ListenerDrops) {
	d.Outbound += o.Outbound
	d.Inbound += o.Inbound
	d.HBONE += o.HBONE
	d.DNS += o.DNS
}

// ListenerDrops sums the drops of every pod's listeners and DNS socket,
// those of pods served before included.
func (t *Tunnel) ListenerDrops() ListenerDrops {
	t.mu.Lock()
	defer t.mu.Unlock()
	sum := t.retiredDrops
	for _, p := range t.pods {
		sum.add(p.drops())
	}
	return sum
}

// drops reads the kernel's drop counts of the pod's sockets. A socket
// that cannot be read (closed meanwhile) counts nothing.
func (p *pod) drops() ListenerDrops {
	p.mu.Lock()
	lns, dns := p.lns, p.dns
	p.mu.Unlock()
	var d ListenerDrops
	for i, l := range lns {
		n, _ := socketDrops(l)
		switch i {
		case 0:
			d.Outbound = n
		case 1:
			d.Inbound = n
		case 2:
			d.HBONE = n
		}
	}
	if dns != nil {
		d.DNS, _ = socketDrops(dns)
	}
	return d
}

// socketDrops reads a socket's sk_drops: for a TCP listener, the SYNs and
// handshakes turned away because a queue was full; for a UDP socket, the
// datagrams turned away because its receive queue was full.
func socketDrops(s any) (uint64, error) {
	sc, ok := s.(syscall.Conn)
	if !ok {
		return 0, fmt.Errorf("drop count: %T has no file descriptor", s)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("drop count: %w", err)
	}
	var mem [unix.SK_MEMINFO_VARS]uint32
	var gerr error
	err = rc.Control(func(fd uintptr) {
		size := uint32(unsafe.Sizeof(mem))
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_SOCKET, unix.SO_MEMINFO,
			uintptr(unsafe.Pointer(&mem[0])), uintptr(unsafe.Pointer(&size)), 0)
		if errno != 0 {
			gerr = errno
		}
	})
	if err == nil {
		err = gerr
	}
	if err != nil {
		return 0, fmt.Errorf("drop count: SO_MEMINFO: %w", err)
	}
	return uint64(mem[unix.SK_MEMINFO_DROPS]), nil
}
