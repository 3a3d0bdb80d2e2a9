package tunnel

import (
	"context"
	"testing"
	"time"
)

// TestDNSHandoverTwoUpgradesInARow: an agent upgraded twice (A, then B,
// then C) passes the very socket A opened on to C: B serves the socket it
// took from A to its own successor, and queries queued on it while no
// agent reads are answered by C once B drained.
func TestDNSHandoverTwoUpgradesInARow(t *testing.T) {
	ns := dnsPodNS(t)
	captureDNS(t, ns)
	a, aPod := dnsAgent(t, ns, dnsOldUpstream, nil, nil)
	aSock, aStop := serveHandover(t, a)
	b, bPod := dnsAgent(t, ns, dnsOldUpstream, mustPredecessor(t, aSock), nil)
	if got := handoverCount(b, handoverTaken); got != 2 {
		t.Fatalf("B took %v, want 2", got)
	}
	ia := socketInode(t, aPod.dnsSocket())
	_ = aStop()
	dctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	a.Drain(dctx, nil)

	bSock, bStop := serveHandover(t, b)
	cLog := newTestLog()
	c, cPod := dnsAgent(t, ns, dnsNewUpstream, mustPredecessor(t, bSock), cLog)
	if got := handoverCount(c, handoverTaken); got != 2 {
		t.Fatalf("C took %v, want 2; log:\n%s", got, cLog.String())
	}
	ib, ic := socketInode(t, bPod.dnsSocket()), socketInode(t, cPod.dnsSocket())
	if ia != ib || ib != ic {
		t.Errorf("DNS socket inodes A %d, B %d, C %d: want one socket", ia, ib, ic)
	}
	// B stops reading; queries queue; B drains; C answers them all.
	_ = bPod.dnsSocket().SetReadDeadline(time.Now())
	_ = cPod.dnsSocket().SetReadDeadline(time.Now())
	time.Sleep(50 * time.Millisecond)
	clients := newDNSClients(t, ns, 8)
	const queued = 16
	for range queued {
		clients.send()
	}
	time.Sleep(100 * time.Millisecond)
	_ = bStop()
	dctx2, cancel2 := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel2()
	b.Drain(dctx2, nil)
	// C reads again: a successor of its own, serving the same socket.
	cSock, _ := serveHandover(t, c)
	d, _ := dnsAgent(t, ns, dnsNewUpstream, mustPredecessor(t, cSock), nil)
	if got := handoverCount(d, handoverTaken); got != 2 {
		t.Fatalf("D took %v, want 2", got)
	}
	if missing, dup, by := clients.result(3 * time.Second); missing != 0 || dup != 0 {
		t.Errorf("%d of %d queued queries unanswered, %d twice (answers %v)", missing, queued, dup, by)
	}
}
