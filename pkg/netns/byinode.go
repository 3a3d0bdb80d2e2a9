package netns

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"sync"

	"golang.org/x/sys/unix"
)

// Index finds pods' network namespaces by address as Finder does, but
// remembers what it saw, by namespace inode: a lookup stats every candidate
// path and enters only the namespaces it has not listed before, newest
// first, until every address is found, so finding one new pod on a node
// with hundreds costs about one namespace entry instead of hundreds. Processes' namespaces (/proc) are walked only when the named
// ones do not have every address, and known namespaces are listed again
// only as a last resort (an address may have been added after a namespace
// was first listed: the CNI plugin creates the namespace before it
// configures it). Addresses found are checked against their namespace's
// inode before they are trusted, so a path reused by another namespace is
// never returned for the old one. What it keeps is bounded by the
// namespaces on the node: entries of namespaces that are gone are dropped
// at the next walk.
type Index struct {
	f *Finder

	mu     sync.Mutex
	known  map[uint64]indexedNS
	byAddr map[netip.Addr]uint64 // address -> inode of the namespace holding it
}

type indexedNS struct {
	path  string
	addrs []netip.Addr
	proc  bool // found under /proc (dropped only by a full /proc walk)
}

// NewIndex returns an Index over f's candidate places.
func NewIndex(f *Finder) *Index {
	return &Index{f: f, known: map[uint64]indexedNS{}, byAddr: map[netip.Addr]uint64{}}
}

// Len is how many namespaces the index remembers.
func (x *Index) Len() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.known)
}

// ScanFor maps each address of want to the path of a namespace holding it;
// addresses no candidate namespace holds are left out.
func (x *Index) ScanFor(want []netip.Addr) (map[netip.Addr]string, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	out := map[netip.Addr]string{}
	missing := map[netip.Addr]bool{}
	for _, a := range want {
		missing[a.Unmap()] = true
	}
	resolve := func() {
		for a := range missing {
			ino, ok := x.byAddr[a]
			if !ok {
				continue
			}
			ns := x.known[ino]
			if cur, err := Inode(ns.path); err == nil && cur == ino {
				out[a] = ns.path
				delete(missing, a)
			}
		}
	}
	resolve()
	if len(missing) == 0 {
		return out, nil
	}
	own, err := OwnInode() // not /proc/self: the main thread may be in a pod's
	if err != nil {
		return out, err
	}
	var errs []error
	// 1. Named namespaces: every path is stat'ed (which also tells which
	// namespaces are gone), new ones are entered newest first (a pod being
	// enrolled has the newest), until every address is found.
	named := x.candidates(x.namedPaths(&errs), own)
	x.prune(named, false)
	x.enterNew(named, false, &errs, func() bool { resolve(); return len(missing) == 0 })
	// 2. Processes' namespaces, new ones only, the same way.
	if len(missing) > 0 && x.f.ProcDir != "" {
		procs := x.candidates(x.procPaths(), own)
		x.prune(procs, true)
		x.enterNew(procs, true, &errs, func() bool { resolve(); return len(missing) == 0 })
	}
	// 3. Last resort: list the known namespaces again.
	if len(missing) > 0 {
		for ino, ns := range x.known {
			x.list(ino, ns.path, ns.proc, &errs)
		}
		resolve()
	}
	if len(out) == 0 && len(errs) > 0 {
		return out, errors.Join(errs...)
	}
	return out, nil
}

// prune forgets the known namespaces of one kind (named, or under /proc)
// that c no longer has at their path. The kernel reuses a namespace's
// inode number once the namespace is freed, so a new pod's namespace may
// come with the number of one that left, at another path: known by number
// alone, it would never be entered and its addresses never found.
func (x *Index) prune(c candidateSet, proc bool) {
	for ino, ns := range x.known {
		if ns.proc != proc {
			continue
		}
		cand, live := c.byIno[ino]
		if !live || cand.path != ns.path && !hasInode(ns.path, ino) {
			x.forget(ino)
		}
	}
}

func hasInode(path string, ino uint64) bool {
	cur, err := Inode(path)
	return err == nil && cur == ino
}

func (x *Index) namedPaths(errs *[]error) []string {
	var paths []string
	for _, dir := range x.f.NetNSDirs {
		entries, err := os.ReadDir(dir)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			*errs = append(*errs, fmt.Errorf("read %s: %w", dir, err))
		}
		for _, e := range entries {
			paths = append(paths, filepath.Join(dir, e.Name()))
		}
	}
	return paths
}

func (x *Index) procPaths() []string {
	entries, _ := os.ReadDir(x.f.ProcDir)
	var paths []string
	for _, e := range entries {
		if name := e.Name(); name[0] >= '0' && name[0] <= '9' {
			paths = append(paths, filepath.Join(x.f.ProcDir, name, "ns", "net"))
		}
	}
	return paths
}

// candidateSet is the namespaces at a set of paths, by inode (the first
// path of each), with their creation times.
type candidateSet struct {
	byIno map[uint64]candidate
}

type candidate struct {
	path    string
	created int64 // ctime of the namespace inode, ns
}

func (x *Index) candidates(paths []string, own uint64) candidateSet {
	c := candidateSet{byIno: map[uint64]candidate{}}
	for _, p := range paths {
		var st unix.Stat_t
		if unix.Stat(p, &st) != nil || st.Ino == own {
			continue
		}
		if _, dup := c.byIno[st.Ino]; !dup {
			c.byIno[st.Ino] = candidate{path: p, created: st.Ctim.Nano()}
		}
	}
	return c
}

// enterNew lists the namespaces of c not known yet, newest first, until
// done says every address is found.
func (x *Index) enterNew(c candidateSet, proc bool, errs *[]error, done func() bool) {
	type entry struct {
		ino uint64
		candidate
	}
	var fresh []entry
	for ino, cand := range c.byIno {
		if _, ok := x.known[ino]; !ok {
			fresh = append(fresh, entry{ino, cand})
		}
	}
	sort.Slice(fresh, func(i, j int) bool { return fresh[i].created > fresh[j].created })
	for _, e := range fresh {
		x.list(e.ino, e.path, proc, errs)
		if done() {
			return
		}
	}
}

// list enters the namespace and records its addresses.
func (x *Index) list(ino uint64, path string, proc bool, errs *[]error) {
	addrs, err := addrsIn(path)
	if err != nil {
		*errs = append(*errs, err)
		return
	}
	x.forget(ino)
	x.known[ino] = indexedNS{path: path, addrs: addrs, proc: proc}
	for _, a := range addrs {
		if _, taken := x.byAddr[a]; !taken {
			x.byAddr[a] = ino
		}
	}
}

func (x *Index) forget(ino uint64) {
	for _, a := range x.known[ino].addrs {
		if x.byAddr[a] == ino {
			delete(x.byAddr, a)
		}
	}
	delete(x.known, ino)
}
