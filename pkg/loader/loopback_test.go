package loader_test

import (
	"bytes"
	"context"
	"net/netip"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestLoopbackDestinationNeverLeavesThePod: an app without any capability
// binds its socket to the pod's interface (SO_BINDTODEVICE needs none on a
// socket not yet bound to a device, since Linux 5.7) and connects to a
// loopback address. The route then is the interface's, not lo's, and the
// SYN leaves the pod with destination 127.0.0.1; the egress program
// excluded loopback destinations from capture, so it left uncaptured, in
// plaintext, towards a node that may take it (route_localnet, which
// kube-proxy sets, and services the node keeps on its own loopback). TCP to a
// loopback address never belongs on the pod's interface.
func TestLoopbackDestinationNeverLeavesThePod(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	client := node.AddPod("client")
	root := loadertest.TempBPFFS(t)
	l := loadertest.Load(t, root)
	defer l.Close()
	if _, err := l.AttachPod(context.Background(), loadertest.PodOf(client, true)); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		src, dst netip.Addr
	}{
		{client.IPv4, netip.MustParseAddr("127.0.0.1")},
		{client.IPv6, netip.IPv6Loopback()},
	} {
		t.Run(c.dst.String(), func(t *testing.T) {
			wire := netnstest.Capture(t, node.Path(), "")
			err := connectBoundToDevice(client.Path(), "eth0", netip.AddrPortFrom(c.dst, 8080))
			if err == nil {
				t.Fatal("connect succeeded")
			}
			// the IP header's source and destination, back to back
			if bytes.Contains(wire(), append(c.src.AsSlice(), c.dst.AsSlice()...)) {
				t.Errorf("a meshed pod's TCP to %s left the pod uncaptured (connect: %v)", c.dst, err)
			}
		})
	}
	if reasonCount(t, l.Maps(), "drop_loopback") == 0 {
		t.Error("drop_loopback was not counted") // a fresh pin root: it starts at 0
	}
}

// connectBoundToDevice connects to dst from inside the namespace at path,
// on a thread with no capabilities, from a socket bound to dev; it waits
// up to a second.
func connectBoundToDevice(path, dev string, dst netip.AddrPort) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread is in the pod's namespace, without capabilities
		errc <- func() error {
			ns, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			err = unix.Setns(ns, unix.CLONE_NEWNET)
			unix.Close(ns)
			if err != nil {
				return err
			}
			hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
			var none [2]unix.CapUserData
			if err := unix.Capset(&hdr, &none[0]); err != nil {
				return err
			}
			family := unix.AF_INET6
			var sa unix.Sockaddr = &unix.SockaddrInet6{Addr: dst.Addr().As16(), Port: int(dst.Port())}
			if dst.Addr().Is4() {
				family, sa = unix.AF_INET, &unix.SockaddrInet4{Addr: dst.Addr().As4(), Port: int(dst.Port())}
			}
			fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			if err := unix.SetsockoptString(fd, unix.SOL_SOCKET, unix.SO_BINDTODEVICE, dev); err != nil {
				return err
			}
			err = unix.Connect(fd, sa)
			if err != unix.EINPROGRESS {
				return err
			}
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
			if n, err := unix.Poll(pfd, 1000); err != nil || n == 0 {
				return unix.ETIMEDOUT
			}
			soerr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
			if err != nil {
				return err
			}
			if soerr != 0 {
				return unix.Errno(soerr)
			}
			return nil
		}()
	}()
	return <-errc
}
