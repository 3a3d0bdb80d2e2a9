package netnstest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// Linux's kTLS interface (linux/tls.h), which x/sys/unix does not carry.
const (
	tlsTX              = 1
	tls12Version       = 0x0303
	tlsCipherAESGCM128 = 51
)

// TestSockopsAccelerationKTLS: an app's TLS library hands its keys to the
// kernel once its handshake is done (kTLS: TCP_ULP "tls", then TLS_TX), so
// on a socket the acceleration paired when it was established. kTLS runs the
// socket's sk_msg program on the plaintext of each record before it
// encrypts it, and a redirect sends that plaintext to the tunnel, which
// passes it on as the app's bytes: to a destination outside the mesh, in the
// clear on the wire. (Found by reading tls_sw.c's bpf_exec_tx_verdict; the
// kernel this was written on has no TLS ULP, so there the test skips.)
// Records must leave encrypted: the sk_msg program falls back to TCP for a
// socket with a ULP.
func TestSockopsAccelerationKTLS(t *testing.T) {
	var client, plain *Pod
	ms := newMeshWith(t, []string{"--sockops-acceleration=true"}, func(tp *Topology, m *Manifest) {
		client, plain = tp.Nodes[0].AddPod("client"), tp.Nodes[1].AddPod("plain")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
			Pod(client, "mesh", "client").Pod(plain, "plain", "default")
	})
	got := make(chan []byte, 1)
	ServeTCP(t, plain, 9500, func(c net.Conn) {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		b, _ := io.ReadAll(c)
		got <- b
	})
	ms.agents[0].WaitLog(t, "pod enrolled", 10*time.Second) // the client's node; the other has no meshed pod
	var fd int
	err := netns.Do(client.Path(), func() error {
		var err error
		if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		return unix.Connect(fd, &unix.SockaddrInet4{Addr: plain.IPv4.As4(), Port: 9500})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	time.Sleep(20 * time.Millisecond) // paired by now
	// A handshake's worth of bytes first, as the TLS library's would be.
	if _, err := unix.Write(fd, []byte("handshake")); err != nil {
		t.Fatal(err)
	}
	if err := unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_ULP, "tls"); err != nil {
		if errors.Is(err, unix.ENOENT) {
			t.Skip("this kernel has no TLS upper layer protocol (CONFIG_TLS)")
		}
		t.Fatalf("TCP_ULP tls: %v", err)
	}
	// struct tls12_crypto_info_aes_gcm_128: version, cipher, iv[8],
	// key[16], salt[4], rec_seq[8].
	info := make([]byte, 40)
	binary.NativeEndian.PutUint16(info[0:], tls12Version)
	binary.NativeEndian.PutUint16(info[2:], tlsCipherAESGCM128)
	for i := 4; i < 32; i++ {
		info[i] = byte(i)
	}
	if err := unix.SetsockoptString(fd, unix.SOL_TLS, tlsTX, string(info)); err != nil {
		t.Fatalf("TLS_TX: %v", err)
	}
	before := accelTotals(t, ms)
	secret := []byte("the app's secret, sent under TLS")
	if _, err := unix.Write(fd, secret); err != nil {
		t.Fatal(err)
	}
	unix.Shutdown(fd, unix.SHUT_WR)
	var b []byte
	select {
	case b = <-got:
	case <-time.After(15 * time.Second):
		t.Fatal("the server read nothing")
	}
	t.Logf("the server read %d bytes; counters %+v", len(b), accelTotals(t, ms).Sub(before))
	if bytes.Contains(b, secret) {
		t.Errorf("the app's kTLS payload reached the destination outside the mesh in the clear: %q", b)
	}
	if i := bytes.Index(b, []byte("handshake")); i != 0 || len(b) < len("handshake")+5 || b[len("handshake")] != 0x17 {
		t.Errorf("the server read %q, want the handshake bytes and then a TLS application data record", b)
	}
}
