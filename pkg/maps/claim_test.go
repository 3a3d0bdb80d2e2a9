package maps

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// tempBPFFS mounts a bpffs on a directory of the test's own and unmounts it
// at the end.
func tempBPFFS(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for a bpffs; CI runs this as root")
	}
	root := filepath.Join(t.TempDir(), "bpf")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("bpf", root, "bpf", 0, ""); err != nil {
		t.Fatalf("mount bpffs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	return root
}

func pinMap(t *testing.T, path string, spec *ebpf.MapSpec) *ebpf.Map {
	t.Helper()
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if err := m.Pin(path); err != nil {
		t.Fatal(err)
	}
	return m
}

// changeUnderWay is an agent (old) that holds the node under a new pin root
// and is in the middle of an enrollment change: release ends it.
func changeUnderWay(t *testing.T) (root string, old *Claim, release func()) {
	t.Helper()
	root = tempBPFFS(t)
	if err := PinLayout(root); err != nil {
		t.Fatal(err)
	}
	old, err := ClaimNode(context.Background(), root, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { old.Close() })
	release, err = old.Guard(context.Background())
	if err != nil {
		t.Fatalf("guard of the agent holding the node: %v", err)
	}
	return root, old, release
}

// TestClaimWaitsForChangesUnderWay: an agent that read Held and then lost
// the node must not still change the enrollment. A claim waits for the
// older agent's change under way, and after it every guard of the older
// agent fails with ErrNotHeld.
func TestClaimWaitsForChangesUnderWay(t *testing.T) {
	root, old, release := changeUnderWay(t)
	claimed := make(chan *Claim, 1)
	go func() {
		c, err := ClaimNode(context.Background(), root, nil)
		if err != nil {
			t.Error(err)
		}
		claimed <- c
	}()
	select {
	case <-claimed:
		t.Fatal("the new agent claimed the node while the old one was attaching a pod")
	case <-time.After(200 * time.Millisecond):
	}
	release()
	var next *Claim
	select {
	case next = <-claimed:
	case <-time.After(5 * time.Second):
		t.Fatal("claim still waiting after the old agent's change finished")
	}
	if next == nil {
		t.FailNow()
	}
	defer next.Close()
	if _, err := old.Guard(context.Background()); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("old agent's guard after the claim: %v, want ErrNotHeld", err)
	}
	rel, err := next.Guard(context.Background())
	if err != nil {
		t.Fatalf("new agent's guard: %v", err)
	}
	// Guards of one agent do not exclude each other.
	rel2, err := next.Guard(context.Background())
	if err != nil {
		t.Fatalf("second guard of the new agent: %v", err)
	}
	rel()
	rel2()
}

// TestLockWaitNamesHolderAndGivesUp: a new agent waiting for an old agent
// hung in an enrollment change (holding the pin root's shared lock) waited
// in silence, for ever. It now logs who holds the lock while it waits, and
// gives up after LockPatience, or when its context ends, with an error
// naming the holder; the old agent keeps the node.
func TestLockWaitNamesHolderAndGivesUp(t *testing.T) {
	root, old, hung := changeUnderWay(t)
	defer func(p, q, n time.Duration) { LockPatience, lockQuietFor, lockNagEvery = p, q, n }(LockPatience, lockQuietFor, lockNagEvery)
	LockPatience, lockQuietFor, lockNagEvery = 400*time.Millisecond, 50*time.Millisecond, time.Hour

	var logged strings.Builder
	log := slog.New(slog.NewTextHandler(&logged, nil))
	holder := fmt.Sprintf("pid %d (", os.Getpid())
	start := time.Now()
	_, err := ClaimNode(context.Background(), root, log)
	if err == nil || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "held by "+holder) {
		t.Fatalf("claim while an old agent's change hangs: %v; want the deadline, naming %q", err, holder)
	}
	if waited := time.Since(start); waited < LockPatience || waited > LockPatience+2*time.Second {
		t.Errorf("claim gave up after %s, want about %s", waited, LockPatience)
	}
	if out := logged.String(); strings.Count(out, "waiting for the pin root lock") != 1 || !strings.Contains(out, `held_by="`+holder) {
		t.Errorf("log while waiting: %q; want one warning naming %q", out, holder)
	}
	if !old.Held() {
		t.Error("the old agent lost the node to a claim that failed")
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Quiesce(ctx, root, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("quiesce with its context ended: %v, want context.Canceled", err)
	}

	hung()
	next, err := ClaimNode(context.Background(), root, log)
	if err != nil {
		t.Fatalf("claim once the change is done: %v", err)
	}
	next.Close()
}

// TestLayoutZeroVersion: an rd_layout whose version was never written (an
// agent died between pinning it and writing it) is judged by the maps
// beside it, not refused as "layout 0" by every later agent.
func TestLayoutZeroVersion(t *testing.T) {
	root := tempBPFFS(t)
	pinMap(t, filepath.Join(root, LayoutName), &ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 2})
	if err := CheckLayout(root); err != nil {
		t.Fatalf("zeroed rd_layout on a fresh root: %v", err)
	}
	pinMap(t, filepath.Join(root, PodsName), &ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	pinMap(t, filepath.Join(root, PodMetaName), &ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err := CheckLayout(root); err != nil {
		t.Fatalf("zeroed rd_layout beside unversioned maps (layout 1): %v", err)
	}
	if err := PinLayout(root); err != nil {
		t.Fatal(err)
	}
	if v, ok, err := readLayout(root); err != nil || !ok || v != LayoutVersion() {
		t.Fatalf("after PinLayout: version %d recorded %v (%v), want %d", v, ok, err, LayoutVersion())
	}
}

// TestLayoutPartialPinSet: a root missing some of the maps is not fresh,
// and one with pods pinned but no metadata map is refused rather than
// loaded with an empty one (whose pod ids would collide with the pinned
// pods').
func TestLayoutPartialPinSet(t *testing.T) {
	defer func(v string) { layoutVersion = v }(layoutVersion)

	t.Run("metadata only, unversioned", func(t *testing.T) {
		root := tempBPFFS(t)
		pinMap(t, filepath.Join(root, PodMetaName), &ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		layoutVersion = "2"
		if err := CheckLayout(root); !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), "layout version 1") {
			t.Fatalf("layout-2 agent on an unversioned root holding %s: %v, want ErrLayout (layout 1)", PodMetaName, err)
		}
		layoutVersion = "1"
		if err := CheckLayout(root); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("pods without metadata", func(t *testing.T) {
		layoutVersion = "1"
		root := tempBPFFS(t)
		if err := PinLayout(root); err != nil {
			t.Fatal(err)
		}
		pods := pinMap(t, filepath.Join(root, PodsName), &ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		// Empty, as the host-probe object creates it when it loads first.
		if err := CheckLayout(root); err != nil {
			t.Fatalf("an empty rd_pods without %s: %v, want it accepted", PodMetaName, err)
		}
		if err := pods.Put(uint32(1), uint32(7)); err != nil {
			t.Fatal(err)
		}
		if err := CheckLayout(root); !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), PodMetaName) {
			t.Fatalf("rd_pods without %s: %v, want ErrLayout naming it", PodMetaName, err)
		}
	})
	t.Run("pod pins without metadata", func(t *testing.T) {
		layoutVersion = "1"
		root := tempBPFFS(t)
		if err := os.MkdirAll(filepath.Join(root, "pods", "7"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := CheckLayout(root); !errors.Is(err, ErrLayout) {
			t.Fatalf("pod pin directories without %s: %v, want ErrLayout", PodMetaName, err)
		}
	})
}

// TestLockHoldersOfAnotherPIDNamespace: the agent runs in a pod of its own
// PID namespace (no hostPID), and the kernel leaves a lock whose holder is
// not in the namespace of the reading /proc out of /proc/locks altogether
// (no line with pid 0). The agent an upgrade waits for is such a holder:
// the wait was logged, and failed, as held by "an unknown process".
func TestLockHoldersOfAnotherPIDNamespace(t *testing.T) {
	if dir := os.Getenv("MAPS_TEST_LOCKHOLDERS_DIR"); dir != "" {
		// The child, in a PID and mount namespace of its own.
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			t.Fatalf("make mounts private: %v", err)
		}
		if err := unix.Mount("proc", "/proc", "proc", 0, ""); err != nil {
			t.Fatalf("mount proc: %v", err)
		}
		fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		fmt.Printf("HOLDERS=%s\n", lockHolders(fd))
		return
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root for a PID namespace")
	}
	dir := t.TempDir()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Flock(fd, unix.LOCK_SH); err != nil {
		t.Fatal(err)
	}
	if got := lockHolders(fd); !strings.Contains(got, fmt.Sprintf("pid %d", os.Getpid())) {
		t.Fatalf("holders seen from our own namespace: %q, want our pid", got)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestLockHoldersOfAnotherPIDNamespace$", "-test.count=1")
	cmd.Env = append(os.Environ(), "MAPS_TEST_LOCKHOLDERS_DIR="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child in a PID namespace: %v\n%s", err, out)
	}
	_, got, ok := strings.Cut(string(out), "HOLDERS=")
	got, _, _ = strings.Cut(got, "\n")
	if !ok || !strings.Contains(got, "another PID namespace") {
		t.Errorf("holders seen from another PID namespace: %q, want them named as in another PID namespace\n%s", got, out)
	}
}

// TestExclusiveLockAmidOverlappingGuards: a claim (or quiesce) waits for
// the pin root while an agent's enrollment changes overlap, each holding
// the shared lock, with gaps of a millisecond or two between them (a burst
// of pod starts). A waiter blocked in flock(2) is woken at each release and
// takes such a gap; one polling with LOCK_NB every 50 ms must land in one.
// Before, the poll took from half a second to over 20 s (measured: 2.2 s,
// 12 s, 8.9 s, >20 s against 0.08-0.5 s blocked), so a claim beside a busy
// agent could run out of LockPatience and fail the new agent's start.
func TestExclusiveLockAmidOverlappingGuards(t *testing.T) {
	dir := t.TempDir()
	var stop atomic.Bool
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stop.Store(true)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Error(err)
				return
			}
			defer unix.Close(fd)
			for !stop.Load() {
				_ = unix.Flock(fd, unix.LOCK_SH)
				time.Sleep(20 * time.Millisecond)
				_ = unix.Flock(fd, unix.LOCK_UN)
				time.Sleep(time.Duration(1+i) * time.Millisecond)
			}
		}()
	}
	time.Sleep(50 * time.Millisecond)
	for i := range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		start := time.Now()
		release, err := (&rootLock{root: dir}).take(ctx, unix.LOCK_EX, "test")
		cancel()
		if err != nil {
			t.Fatalf("exclusive lock %d amid overlapping shared ones: %v", i, err)
		}
		t.Logf("exclusive lock %d after %s", i, time.Since(start).Round(time.Millisecond))
		release()
		time.Sleep(30 * time.Millisecond)
	}
}

// TestExclusiveLockAmidGaplessGuards: an agent's enrollment changes (two
// streams of them, as pods keep starting) overlap without any gap: each
// change begins before the one before it ends. flock grants every new
// shared lock while an exclusive one waits, so a claim waited out all of
// LockPatience and failed the new agent's start. Through the gate, changes
// that begin while a claim waits wait in turn, those under way end (here
// within 100 ms), and the claim gets the lock; the changes go on after it.
func TestExclusiveLockAmidGaplessGuards(t *testing.T) {
	defer func(p time.Duration) { LockPatience = p }(LockPatience)
	LockPatience = 2 * time.Second
	dir := t.TempDir()
	guards := &rootLock{root: dir} // the old agent's, as a Claim's
	var stop atomic.Bool
	var changes atomic.Int64
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			end := func() {}
			defer func() { end() }()
			for !stop.Load() {
				release, err := guards.take(context.Background(), unix.LOCK_SH, "test change")
				end() // the change before ends once this one began...
				if err != nil {
					errs <- err
					return
				}
				changes.Add(1)
				end = sync.OnceFunc(release)
				time.AfterFunc(100*time.Millisecond, end) // ...or within 100 ms
				time.Sleep(5 * time.Millisecond)
			}
			errs <- nil
		}()
	}
	defer func() {
		stop.Store(true)
		for range 2 {
			if err := <-errs; err != nil {
				t.Errorf("a change's shared lock: %v", err)
			}
		}
	}()

	time.Sleep(50 * time.Millisecond)
	for i := range 3 {
		start := time.Now()
		release, err := (&rootLock{root: dir}).take(context.Background(), unix.LOCK_EX, "test claim")
		waited := time.Since(start)
		if err != nil {
			t.Fatalf("exclusive lock %d amid gapless shared ones: %v", i, err)
		}
		release()
		t.Logf("exclusive lock %d after %s", i, waited.Round(time.Millisecond))
		if waited > time.Second {
			t.Errorf("exclusive lock %d took %s, want the changes under way (100 ms) to end and no new one to start", i, waited)
		}
		before := changes.Load()
		deadline := time.Now().Add(time.Second)
		for changes.Load() < before+4 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if n := changes.Load() - before; n < 4 {
			t.Fatalf("%d changes in the second after exclusive lock %d was released, want them going on", n, i)
		}
	}
	if st, err := os.Lstat(filepath.Join(dir, GateName)); err != nil || !st.IsDir() || st.Mode().Perm() != 0o700 {
		t.Errorf("gate %s: %v (%v), want a directory of mode 0700 as the pin tree's", GateName, st, err)
	}
}

// TestLockWithoutGate: a gate that cannot be made (here a file is in its
// place) does not stop the agent: the root is locked alone, as by an agent
// from before the gate, and the warning comes once.
func TestLockWithoutGate(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, GateName), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	var logged strings.Builder
	l := &rootLock{root: dir, log: slog.New(slog.NewTextHandler(&logged, nil))}
	rel1, err := l.take(context.Background(), unix.LOCK_SH, "test change")
	if err != nil {
		t.Fatalf("shared lock without a gate: %v", err)
	}
	rel2, err := l.take(context.Background(), unix.LOCK_SH, "test change")
	if err != nil {
		t.Fatalf("second shared lock without a gate: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := l.take(ctx, unix.LOCK_EX, "test claim"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("exclusive lock while shared ones are held: %v, want it to wait until its context ends", err)
	}
	rel1()
	rel2()
	release, err := l.take(context.Background(), unix.LOCK_EX, "test claim")
	if err != nil {
		t.Fatalf("exclusive lock once the shared ones are released: %v", err)
	}
	release()
	if n := strings.Count(logged.String(), "without its gate"); n != 1 {
		t.Errorf("%d warnings about the missing gate, want 1:\n%s", n, logged.String())
	}
}
