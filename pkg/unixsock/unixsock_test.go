package unixsock

import (
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// TestConcurrentInstallsOwnWhatTheyServe: two agents installing a socket
// at one path at once (an older agent installing its CNI socket again as a
// restarted newer one installs its own) each end up either with an error,
// or serving the path they think is theirs. The temporary name was the
// path and the process id, which two agents' containers share (each agent
// is PID 1 in its own): one removed the other's temporary socket and bound
// its own there, the other renamed that over the path and recorded its
// inode as its own, serving an unlinked socket while the path held a
// socket nobody served (and its exit could remove the other agent's).
func TestConcurrentInstallsOwnWhatTheyServe(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "cni.sock")
	for round := range 300 {
		type result struct {
			l   net.Listener
			ino uint64
			err error
		}
		var wg sync.WaitGroup
		res := make([]result, 2)
		for i := range res {
			wg.Go(func() {
				l, ino, err := Install("test socket", path, "unix")
				res[i] = result{l, ino, err}
			})
		}
		wg.Wait()
		fi, err := os.Lstat(path)
		if err != nil {
			t.Fatalf("round %d: nothing at the path after two installs: %v (%v, %v)", round, err, res[0].err, res[1].err)
		}
		atPath := inodeOf(fi)
		owners := 0
		for i, r := range res {
			if r.err != nil || r.ino != atPath {
				continue
			}
			owners++
			// The owner must be the one serving the path.
			accepted := make(chan struct{})
			go func() {
				if c, err := r.l.Accept(); err == nil {
					c.Close()
					close(accepted)
				}
			}()
			c, err := net.DialTimeout("unix", path, time.Second)
			if err != nil {
				t.Fatalf("round %d: install %d thinks it owns the path but nothing serves it: %v", round, i, err)
			}
			c.Close()
			select {
			case <-accepted:
			case <-time.After(time.Second):
				t.Fatalf("round %d: install %d thinks it owns the path, which another socket serves", round, i)
			}
		}
		if owners != 1 {
			t.Fatalf("round %d: %d installs think they own the path (errors: %v, %v)", round, owners, res[0].err, res[1].err)
		}
		for _, r := range res {
			if r.l != nil {
				r.l.Close()
			}
		}
		// Temporary names never stay behind.
		if ents, _ := os.ReadDir(dir); len(ents) != 1 {
			var names []string
			for _, e := range ents {
				names = append(names, e.Name())
			}
			t.Fatalf("round %d: directory holds %v, want the socket alone", round, names)
		}
	}
}
