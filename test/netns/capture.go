package netnstest

import (
	"bytes"
	"net"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// Capture records every frame on iface (every interface when iface is "")
// inside the namespace at path until stop is called. A frame a tc egress
// program dropped or redirected never reaches it: packet taps see what an
// interface sent, after tc.
func Capture(t TB, path, iface string) (stop func() []byte) {
	t.Helper()
	var fd int
	err := netns.Do(path, func() error {
		index := 0
		if iface != "" {
			ifi, err := net.InterfaceByName(iface)
			if err != nil {
				return err
			}
			index = ifi.Index
		}
		var err error
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: index})
	})
	if err != nil {
		t.Fatalf("capture on %q: %v", iface, err)
	}
	var mu sync.Mutex
	var buf bytes.Buffer
	done := make(chan struct{})
	go func() {
		defer close(done)
		b := make([]byte, 65536)
		for {
			n, _, err := unix.Recvfrom(fd, b, 0)
			if err != nil {
				return
			}
			mu.Lock()
			buf.Write(b[:n])
			mu.Unlock()
		}
	}()
	return func() []byte {
		unix.Shutdown(fd, unix.SHUT_RDWR)
		unix.Close(fd)
		<-done
		mu.Lock()
		defer mu.Unlock()
		return buf.Bytes()
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }
