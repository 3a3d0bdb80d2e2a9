package netnstest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// agentResources is what one agent holds that pod churn could leak.
type agentResources struct {
	FDs        int
	Goroutines int
	HeapInuse  int64 // bytes in in-use spans, right after a forced GC
	HeapAlloc  int64 // live heap objects, right after a forced GC
	Certs      int   // redirector_certificates, all states but grace
	// Grace counts the identities kept after their last pod left (state
	// grace, 2 minutes, longer than the soak settles): bounded by the pods
	// that left within that, each holding its renewal worker's goroutine.
	Grace  int
	Series int // istio_tcp_* samples exported
	// GoneSeries are the istio_tcp_* samples (without value) that name a
	// workload gone, by gone's test.
	GoneSeries []string
	series     []string       // every istio_tcp_* sample, without value
	Pins       int            // files under the pin root
	MapEntries map[string]int // entries of every pinned hash map, by name
}

func (r agentResources) String() string {
	var m []string
	for _, name := range sortedKeys(r.MapEntries) {
		m = append(m, fmt.Sprintf("%s=%d", name, r.MapEntries[name]))
	}
	return fmt.Sprintf("fds=%d goroutines=%d heap_inuse=%.2fMB heap_alloc=%.2fMB certs=%d in_grace=%d istio_tcp_series=%d pins=%d maps[%s]",
		r.FDs, r.Goroutines, float64(r.HeapInuse)/(1<<20), float64(r.HeapAlloc)/(1<<20), r.Certs, r.Grace, r.Series, r.Pins, strings.Join(m, " "))
}

func sortedKeys(m map[string]int) []string { return slices.Sorted(maps.Keys(m)) }

// soakTolerance is how far above its baseline a resource may end. The
// allowances cover what the runtime and the kernel keep for reasons of
// their own: an fd or goroutine of a connection still closing, the heap of
// sync.Pools, HTTP/2 buffers and the GC's own bookkeeping.
type soakTolerance struct {
	FDs, Goroutines int
	Heap            int64
}

// exceeds names every resource of end beyond base plus tol; certificates,
// series, pins and map entries must be back exactly.
func (tol soakTolerance) exceeds(base, end agentResources) []string {
	var out []string
	if end.FDs > base.FDs+tol.FDs {
		out = append(out, fmt.Sprintf("fds %d -> %d (tolerance +%d)", base.FDs, end.FDs, tol.FDs))
	}
	if end.Goroutines-end.Grace > base.Goroutines-base.Grace+tol.Goroutines {
		out = append(out, fmt.Sprintf("goroutines %d -> %d, of which %d and %d of identities in grace (tolerance +%d)",
			base.Goroutines, end.Goroutines, base.Grace, end.Grace, tol.Goroutines))
	}
	if end.HeapInuse > base.HeapInuse+tol.Heap {
		out = append(out, fmt.Sprintf("heap in use after GC %d -> %d bytes (tolerance +%d)", base.HeapInuse, end.HeapInuse, tol.Heap))
	}
	if end.Certs != base.Certs {
		out = append(out, fmt.Sprintf("cached certificates %d -> %d", base.Certs, end.Certs))
	}
	if len(end.GoneSeries) > 0 {
		out = append(out, fmt.Sprintf("%d istio_tcp_* series (of %d, %d at the baseline) name workloads that left, e.g. %s",
			len(end.GoneSeries), end.Series, base.Series, end.GoneSeries[0]))
	}
	if end.Pins != base.Pins {
		out = append(out, fmt.Sprintf("pins %d -> %d", base.Pins, end.Pins))
	}
	for _, name := range sortedKeys(end.MapEntries) {
		if end.MapEntries[name] != base.MapEntries[name] {
			out = append(out, fmt.Sprintf("%s entries %d -> %d", name, base.MapEntries[name], end.MapEntries[name]))
		}
	}
	return out
}

var (
	goroutineTotal = regexp.MustCompile(`goroutine profile: total (\d+)`)
	heapStat       = regexp.MustCompile(`(?m)^# (HeapInuse|HeapAlloc) = (\d+)$`)
)

// measure reads a's resources; gone says whether a workload name is of a
// workload that left. The heap is read from the heap profile
// with gc=1: the runtime collects first, then reports its MemStats, so the
// figures are the live heap, not what the last cycle left. The smallest of
// three readings is kept, so a scrape in flight does not count.
func measure(a *Agent, gone func(workload string) bool) (agentResources, error) {
	r := agentResources{MapEntries: map[string]int{}}
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", agentPID(a)))
	if err != nil {
		return r, fmt.Errorf("agent fds: %w", err)
	}
	r.FDs = len(ents)
	out, err := CurlFrom(a.Node.Path(), "http://127.0.0.1:15000/debug/pprof/goroutine?debug=1")
	if err != nil {
		return r, err
	}
	m := goroutineTotal.FindStringSubmatch(out)
	if m == nil {
		return r, fmt.Errorf("goroutine profile without a total: %.200s", out)
	}
	r.Goroutines, _ = strconv.Atoi(m[1])
	for i := 0; i < 3; i++ {
		out, err := CurlFrom(a.Node.Path(), "http://127.0.0.1:15000/debug/pprof/heap?gc=1&debug=1")
		if err != nil {
			return r, err
		}
		stats := map[string]int64{}
		for _, m := range heapStat.FindAllStringSubmatch(out, -1) {
			stats[m[1]], _ = strconv.ParseInt(m[2], 10, 64)
		}
		if len(stats) != 2 {
			return r, fmt.Errorf("heap profile without HeapInuse and HeapAlloc")
		}
		if i == 0 || stats["HeapInuse"] < r.HeapInuse {
			r.HeapInuse = stats["HeapInuse"]
		}
		if i == 0 || stats["HeapAlloc"] < r.HeapAlloc {
			r.HeapAlloc = stats["HeapAlloc"]
		}
	}
	metrics, err := CurlFrom(a.Node.Path(), "http://127.0.0.1:15020/metrics")
	if err != nil {
		return r, err
	}
	r.Grace = int(metricSum(metrics, "redirector_certificates", `state="grace"`))
	r.Certs = int(metricSum(metrics, "redirector_certificates")) - r.Grace
	for _, line := range strings.Split(metrics, "\n") {
		if !strings.HasPrefix(line, "istio_tcp_") {
			continue
		}
		r.Series++
		r.series = append(r.series, line[:strings.LastIndexByte(line, ' ')])
		for _, l := range series(line, line[:strings.IndexByte(line, '{')]) {
			if gone(l["source_workload"]) || gone(l["destination_workload"]) {
				r.GoneSeries = append(r.GoneSeries, line[:strings.LastIndexByte(line, ' ')])
			}
		}
	}
	err = filepath.WalkDir(a.BPFRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		r.Pins++
		mp, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return nil // a link or a program
		}
		defer mp.Close()
		switch mp.Type() {
		case ebpf.Array, ebpf.PerCPUArray, ebpf.ProgramArray:
			return nil // every slot always exists
		case ebpf.SkStorage:
			return nil // entries live and die with their sockets; not iterable
		}
		if d.Name() == "rd_dialled" {
			return nil // an LRU: a handshake whose app socket never sent leaves its entry to age out
		}
		n, err := countKeys(mp)
		if err != nil {
			return fmt.Errorf("count %s: %w", path, err)
		}
		rel, _ := filepath.Rel(a.BPFRoot, path)
		r.MapEntries[rel] = n
		return nil
	})
	return r, err
}

// countKeys walks mp's keys (values are not read: per-CPU maps would
// need a slice per CPU).
func countKeys(mp *ebpf.Map) (int, error) {
	var cur any // nil: the first key
	for n := 0; n <= int(mp.MaxEntries()); n++ {
		next := make([]byte, mp.KeySize())
		if err := mp.NextKey(cur, next); errors.Is(err, ebpf.ErrKeyNotExist) {
			return n, nil
		} else if err != nil {
			return n, err
		}
		cur = next
	}
	return 0, fmt.Errorf("more keys than the map holds: it changed while counted")
}

// churnPod is a pod of the soak that comes and goes: its own network
// namespace, created and deleted with the pod, at an address recycled from
// a free list (as a CNI plugin's IPAM recycles them).
type churnPod struct {
	*Pod
	seq  int // makes name, uid, service account and workload unique
	host int
	tr   traffic // of the pod's clients

	mu      sync.Mutex
	closers []func()
}

// addChurnPod creates pod name on n at host number h, as AddPod does, but
// at a chosen address so that addresses can be reused after the pod left.
func addChurnPod(n *Node, name string, h int) *Pod {
	tp := n.topo
	p := &Pod{Node: n, Name: name, NS: fmt.Sprintf("%s-n%d-h%d", tp.prefix, n.Index, h),
		IPv4: n.PodAddr4(h), IPv6: n.PodAddr6(h), HostVeth: fmt.Sprintf("vsoak%dh%d", n.Index, h)}
	tp.addNS(p.NS)
	// The MAC follows the address, as the CNI bridge plugin sets it: a new
	// pod at a recycled address must not wait for the node's neighbor
	// entry of the old pod to fail (~5 s of lost SYNs, mesh or not).
	mac := fmt.Sprintf("0a:58:%02x:%02x:%02x:%02x", 10, tp.slot, n.Index, h)
	tp.ip(n.Name, "link", "add", p.HostVeth, "type", "veth", "peer", "name", "eth0", "address", mac, "netns", p.NS)
	tp.ip(n.Name, "link", "set", p.HostVeth, "master", "rdbr", "up")
	tp.ip(p.NS, "addr", "add", p.IPv4.String()+"/24", "dev", "eth0")
	tp.ip(p.NS, "addr", "add", p.IPv6.String()+"/64", "dev", "eth0", "nodad")
	tp.ip(p.NS, "link", "set", "eth0", "up")
	tp.ip(p.NS, "route", "add", "default", "via", n.Gateway4().String())
	tp.ip(p.NS, "-6", "route", "add", "default", "via", n.Gateway6().String())
	return p
}

// deleteNetNS deletes the pod's namespace, as the runtime does when the
// pod's sandbox goes. The namespace itself lives on while anything (the
// agent's sockets, say) still holds it.
func deleteNetNS(p *Pod) error {
	if out, err := exec.Command("ip", "netns", "del", p.NS).CombinedOutput(); err != nil {
		return fmt.Errorf("ip netns del %s: %w: %s", p.NS, err, out)
	}
	return nil
}

// onClose registers what the pod's app holds, closed when the pod goes.
func (p *churnPod) onClose(f func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closers = append(p.closers, f)
}

// stopApps closes everything the pod's apps hold, newest first, as the
// container runtime's kill does.
func (p *churnPod) stopApps() {
	p.mu.Lock()
	c := p.closers
	p.closers = nil
	p.mu.Unlock()
	for i := len(c) - 1; i >= 0; i-- {
		c[i]()
	}
}

// lineEcho serves port in the pod: every line read is written back, until
// the client closes. The listener and every accepted connection close with
// stop, so the pod's namespace can go away.
func lineEcho(path string, port int) (stop func(), err error) {
	l, err := netns.Listen(context.Background(), path, "tcp", fmt.Sprintf("[::]:%d", port), netns.SocketOptions{})
	if err != nil {
		return nil, fmt.Errorf("listen on %s:%d: %w", path, port, err)
	}
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	closed := false
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if closed {
				mu.Unlock()
				c.Close()
				return
			}
			conns[c] = true
			mu.Unlock()
			go func() {
				defer func() {
					mu.Lock()
					delete(conns, c)
					mu.Unlock()
					c.Close()
				}()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return func() {
		l.Close()
		mu.Lock()
		closed = true
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
	}, nil
}

// traffic counts what the soak's clients did.
type traffic struct {
	ok, failed atomic.Int64
	// cut counts failures once leaving is set: a pod's removal may break
	// its connections.
	cut     atomic.Int64
	leaving atomic.Bool
	mu      sync.Mutex
	errs    []string // the first few failures
}

func (tr *traffic) fail(err error) {
	if tr.leaving.Load() {
		tr.cut.Add(1)
		return
	}
	tr.failed.Add(1)
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if len(tr.errs) < 10 {
		tr.errs = append(tr.errs, time.Now().Format("15:04:05.000")+" "+err.Error())
	}
}

// add adds o's counts to tr.
func (tr *traffic) add(o *traffic) {
	tr.ok.Add(o.ok.Load())
	tr.failed.Add(o.failed.Load())
	tr.cut.Add(o.cut.Load())
	o.mu.Lock()
	defer o.mu.Unlock()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, e := range o.errs {
		if len(tr.errs) < 10 {
			tr.errs = append(tr.errs, e)
		}
	}
}

// exchange sends one line on c and waits for it back.
func exchange(c net.Conn, r *bufio.Reader, line string, timeout time.Duration) error {
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte(line + "\n")); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	got, err := r.ReadString('\n')
	if err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if got != line+"\n" {
		return fmt.Errorf("echo %q, want %q", got, line)
	}
	return nil
}

// shortConns opens one short connection after another from path to dst
// until ctx ends: connect, one line back and forth, close.
func shortConns(ctx context.Context, path, dst string, every time.Duration, tr *traffic) {
	for ctx.Err() == nil {
		err := func() error {
			dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			c, err := netns.Dial(dctx, path, "tcp", dst, netns.SocketOptions{})
			if err != nil {
				return fmt.Errorf("connect: %w", err)
			}
			defer c.Close()
			return exchange(c, bufio.NewReader(c), "ping", 5*time.Second)
		}()
		switch {
		case err == nil:
			tr.ok.Add(1)
		case ctx.Err() == nil:
			tr.fail(fmt.Errorf("%s -> %s: %w", filepath.Base(path), dst, err))
		}
		select {
		case <-ctx.Done():
		case <-time.After(every):
		}
	}
}

// longConn holds one connection from path to dst open until ctx ends,
// exchanging a line every interval. It returns the connection's error, nil
// when ctx ended it.
func longConn(ctx context.Context, path, dst string, every time.Duration) error {
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	c, err := netns.Dial(dctx, path, "tcp", dst, netns.SocketOptions{})
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("%s -> %s: connect: %w", filepath.Base(path), dst, err)
	}
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	defer c.Close()
	r := bufio.NewReader(c)
	for i := 0; ; i++ {
		if err := exchange(c, r, fmt.Sprintf("line %d", i), 5*time.Second); err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			return fmt.Errorf("%s -> %s: line %d: %w", filepath.Base(path), dst, i, err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(every):
		}
	}
}

// saveHeap writes a's heap profile, taken after a GC, to path, for
// `go tool pprof -base baseline end` when the heap did not come back.
func saveHeap(a *Agent, path string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := Exec(ctx, a.Node.Path(), "curl", "-sS", "--max-time", "5", "-o", path, "http://127.0.0.1:15000/debug/pprof/heap?gc=1")
	return err
}

// newSeries lists the istio_tcp_* samples of end that base did not have.
func newSeries(base, end agentResources) []string {
	var out []string
	for _, s := range end.series {
		if !slices.Contains(base.series, s) {
			out = append(out, s)
		}
	}
	return out
}
