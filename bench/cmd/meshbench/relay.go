package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// relayMain is the plain TCP relay behind the capture-only and iptables
// TPROXY variants: what the mesh's outbound path is without TLS, HTTP/2 or
// a second proxy. It runs in the client pod, listens transparently (the
// capture hands it connections to any address; LocalAddr() is the original
// destination), dials that destination with the tunnel mark so the capture
// lets its own packets go, and copies both ways (splice on Linux).
// A line "count" on standard input answers "count N" on standard output:
// the connections relayed so far, so the suite can prove the capture works.
func relayMain(args []string) error {
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	listen := fs.String("listen", "[::]:15001", "transparent listen address")
	network := fs.String("network", "tcp", "tcp (dual stack) or tcp4")
	mark := fs.Int("mark", 0x539, "SO_MARK of every socket (the capture skips it)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	lc := net.ListenConfig{Control: sockopts(*mark, true)}
	l, err := lc.Listen(context.Background(), *network, *listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", *listen, err)
	}
	own := l.Addr().(*net.TCPAddr).Port
	var relayed atomic.Int64
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			if sc.Text() == "count" {
				fmt.Printf("count %d\n", relayed.Load())
			}
		}
	}()
	fmt.Println("ready")
	d := net.Dialer{Control: sockopts(*mark, false), Timeout: 5 * time.Second}
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		relayed.Add(1)
		go relay(c.(*net.TCPConn), d, own)
	}
}

// relayedCount asks a relay child how many connections it carried.
func relayedCount(ctx context.Context, c *child) (int64, error) {
	if _, err := io.WriteString(c.stdin, "count\n"); err != nil {
		return 0, fmt.Errorf("ask %s: %w", c.name, err)
	}
	line, err := c.waitLine(ctx, "count ", 5*time.Second)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimPrefix(line, "count "), 10, 64)
}

func relay(down *net.TCPConn, d net.Dialer, own int) {
	defer down.Close()
	dst := down.LocalAddr().(*net.TCPAddr).AddrPort()
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	if int(dst.Port()) == own {
		return // someone dialled the relay itself: no loop
	}
	c, err := d.Dial("tcp", dst.String())
	if err != nil {
		// Rare and telling: the suite shows this when a test fails.
		fmt.Fprintf(os.Stderr, "%s relay %s -> %s: %v\n", time.Now().Format("15:04:05.000"), down.RemoteAddr(), dst, err)
		return
	}
	up := c.(*net.TCPConn)
	defer up.Close()
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(up, down)
		_ = up.CloseWrite()
		close(done)
	}()
	_, _ = io.Copy(down, up)
	_ = down.CloseWrite()
	<-done
}

// sockopts sets SO_MARK and, for listeners, IP(V6)_TRANSPARENT.
func sockopts(mark int, transparent bool) func(network, address string, c syscall.RawConn) error {
	return func(network, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, mark); serr != nil {
				serr = fmt.Errorf("SO_MARK %#x: %w", mark, serr)
				return
			}
			if !transparent {
				return
			}
			// network is what the socket became: tcp4, or tcp6 (dual stack).
			if network == "tcp4" {
				if serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1); serr != nil {
					serr = fmt.Errorf("IP_TRANSPARENT: %w", serr)
				}
				return
			}
			if serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1); serr != nil {
				serr = fmt.Errorf("IPV6_TRANSPARENT: %w", serr)
			}
		})
		if err != nil {
			return err
		}
		return serr
	}
}

// hostPort joins an address and a port for a command line.
func hostPort(a netip.Addr, port int) string { return net.JoinHostPort(a.String(), strconv.Itoa(port)) }
