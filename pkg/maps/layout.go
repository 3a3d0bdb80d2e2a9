package maps

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// LayoutName is the pinned array of two uint32 beside the maps: the layout
// version of the maps (slot 0) and the token of the agent that holds the
// node (slot 1, see ClaimNode).
const LayoutName = "rd_layout"

const (
	layoutSlotVersion = uint32(0)
	layoutSlotOwner   = uint32(1)
)

// layoutVersion is the layout of the state maps (rd_pods, rd_pod_meta,
// rd_pod_stats) this build reads and writes. Bump it with any change to
// their key or value types that an agent of the previous layout would
// misread. Tests build an agent with another value through
// -ldflags "-X github.com/redirector-mesh/redirector/pkg/maps.layoutVersion=N".
var layoutVersion = "1"

// LayoutVersion is this build's layout version.
func LayoutVersion() uint32 {
	v, err := strconv.ParseUint(layoutVersion, 10, 32)
	if err != nil || v == 0 {
		panic(fmt.Sprintf("maps: bad layoutVersion %q built in", layoutVersion))
	}
	return uint32(v)
}

// ErrLayout is returned when the pinned maps have a layout this build
// cannot use.
var ErrLayout = errors.New("incompatible pinned map layout")

// CheckLayout refuses a pin root whose maps were pinned with another
// layout version, before anything under it is touched: a new agent must
// neither misread the old state nor replace maps the running programs (and
// the agent still serving, during an overlapping upgrade) use. Maps pinned
// by an agent from before versioning have layout 1. An empty root passes.
//
// It also refuses a partial pin set it cannot take over: pods pinned (an
// rd_pods map or pod link pins) without the metadata map that says which
// pod id is whose. Loading would create an empty metadata map and hand out
// ids the pinned pods still use.
func CheckLayout(root string) error {
	want := LayoutVersion()
	got, pinned, err := readLayout(root)
	if err != nil {
		return err
	}
	if !pinned {
		if !hasState(root) {
			return nil // a fresh root
		}
		got = 1
	}
	if got != want {
		return fmt.Errorf("%w: the maps pinned under %s have layout version %d, this agent reads layout %d and does not "+
			"migrate them. The pods stay redirected by the programs pinned there (fail closed while no agent of layout %d "+
			"serves them). Either run a release with layout %d on this node, or drain the node, run `redirector uninstall "+
			"--bpf-root %s` (its pods are not redirected until this agent enrolls them again) and start this agent",
			ErrLayout, root, got, want, got, got, root)
	}
	if !pinExists(filepath.Join(root, PodMetaName)) && (hasEntries(filepath.Join(root, PodsName)) || hasPodPins(root)) {
		return fmt.Errorf("%w: %s holds pinned pods but no %s, so which pod id is whose is lost. The pods stay redirected "+
			"by the programs pinned there. Drain the node, run `redirector uninstall --bpf-root %s` and start this agent",
			ErrLayout, root, PodMetaName, root)
	}
	return nil
}

// stateMaps are the pinned maps that hold enrollment state.
var stateMaps = []string{PodsName, PodMetaName, PodNetNSName, PodStatsName}

// hasState reports whether any state of an agent is pinned under root: one
// of its state maps or a pod's pins. A root missing some of them is not
// fresh.
func hasState(root string) bool {
	for _, name := range stateMaps {
		if pinExists(filepath.Join(root, name)) {
			return true
		}
	}
	return hasPodPins(root)
}

// hasPodPins reports whether root/pods holds any pod directory.
func hasPodPins(root string) bool {
	ents, err := os.ReadDir(filepath.Join(root, "pods"))
	return err == nil && len(ents) > 0
}

// hasEntries reports whether the pinned map at path holds any entry. An
// empty rd_pods is not a pod: the host-probe object creates it when it
// loads first, before the loader pins the metadata beside it.
func hasEntries(path string) bool {
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return pinExists(path) // unreadable: judge it held, fail closed
	}
	defer m.Close()
	key := make([]byte, m.KeySize())
	return m.NextKey(nil, &key) == nil
}

func pinExists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// PinLayout records this build's layout version under root (after the
// maps were loaded or created there). A new rd_layout is pinned only once
// its version is written: an agent that dies in between leaves no pin,
// rather than one whose zeroed version every later agent would refuse.
func PinLayout(root string) error {
	path := filepath.Join(root, LayoutName)
	m, err := ebpf.LoadPinnedMap(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		m, err = ebpf.NewMap(&ebpf.MapSpec{Name: LayoutName, Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 2})
		if err == nil {
			if err = m.Put(layoutSlotVersion, LayoutVersion()); err == nil {
				err = m.Pin(path)
			}
			if err != nil {
				m.Close()
			}
		}
	}
	if err != nil {
		return fmt.Errorf("pin %s: %w", path, err)
	}
	defer m.Close()
	if err := m.Put(layoutSlotVersion, LayoutVersion()); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// readLayout returns the version pinned under root and whether there is one.
func readLayout(root string) (uint32, bool, error) {
	path := filepath.Join(root, LayoutName)
	m, err := ebpf.LoadPinnedMap(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("open %s: %w", path, err)
	}
	defer m.Close()
	var v uint32
	if m.KeySize() != 4 || m.ValueSize() != 4 || m.MaxEntries() < 2 {
		return 0, false, fmt.Errorf("%w: %s has key/value sizes %d/%d and %d entries, want 4/4 and 2", ErrLayout, path, m.KeySize(), m.ValueSize(), m.MaxEntries())
	}
	if err := m.Lookup(layoutSlotVersion, &v); err != nil {
		return 0, false, fmt.Errorf("read %s: %w", path, err)
	}
	// Version 0 was never written (an agent died between pinning and
	// writing it, before PinLayout wrote first): judge the maps as if
	// unversioned.
	return v, v != 0, nil
}

// Claim is an agent's hold on the node's pinned state. Two agents overlap
// during an upgrade; only the newest may change the enrollment (attach,
// detach, repair), or the two would race on the same pods: each keeps its
// own index of pod ids, so both could give one id to two pods. The older
// one sees Held turn false and only serves the pods it has until it drains.
//
// Held alone is a check, not a hold: an older agent could read it, lose the
// node, and still write. So every enrollment change runs under Guard, a
// shared flock(2) of the pin root, and a claim takes it exclusively: a
// claim waits for changes under way, and no change starts unclaimed after
// it. The lock is per open file, so it holds across the agents' mount and
// PID namespaces (both see the same bpffs directory), and a dead agent's
// lock goes with its descriptors. A gate in front of it (rootLock) makes
// new changes wait for a claim that waits, instead of keeping it out.
type Claim struct {
	lock  rootLock
	m     *ebpf.Map
	token uint32
}

// ErrNotHeld is returned by Guard once a newer agent claimed the node.
var ErrNotHeld = errors.New("a newer agent holds the node")

// ClaimNode makes the caller the agent that holds the node under root (the
// maps must be loaded there, Load pins rd_layout). It waits for changes
// another agent has under way (see Claim), at most LockPatience and while
// ctx lasts, logging to log who holds them up. Close releases the map.
func ClaimNode(ctx context.Context, root string, log *slog.Logger) (*Claim, error) {
	return ClaimNodeThen(ctx, root, log, nil)
}

// ClaimNodeThen is NewClaim followed by Take.
func ClaimNodeThen(ctx context.Context, root string, log *slog.Logger, then func()) (*Claim, error) {
	c, err := NewClaim(root, log)
	if err != nil {
		return nil, err
	}
	if err := c.Take(ctx, then); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// NewClaim opens the node's claim for this agent without taking it: Held
// is false, Guard refuses and Release leaves the node alone until Take.
// An agent takes the node only once it has mesh state to apply
// (nodeagent.Config.TakeNode); Close releases the map.
func NewClaim(root string, log *slog.Logger) (*Claim, error) {
	path := filepath.Join(root, LayoutName)
	m, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		return nil, fmt.Errorf("claim the node: open %s: %w", path, err)
	}
	var b [4]byte
	c := &Claim{lock: rootLock{root: root, log: log}, m: m}
	for c.token == 0 {
		if _, err := rand.Read(b[:]); err != nil {
			m.Close()
			return nil, fmt.Errorf("claim the node: %w", err)
		}
		c.token = binary.LittleEndian.Uint32(b[:])
	}
	return c, nil
}

// Take makes the caller the agent that holds the node. It waits for
// changes another agent has under way (see Claim), at most LockPatience and
// while ctx lasts, logging who holds them up. then (if not nil) runs once
// the claim is written, before the pin root's exclusive lock is let go: no
// other agent changes the pinned state meanwhile, and an older agent taking
// the node back (ReclaimThen) runs its own then either wholly before or not
// at all. The agent reads the pinned state again and points the pinned
// links at its programs there (loader.Relink): the older agent went on
// attaching and detaching pods since this one's Load, and a take-back's
// relink in that time left the pods on the older agent's programs. then
// must not take a Guard or the lock: it would wait for itself.
func (c *Claim) Take(ctx context.Context, then func()) error {
	unlock, err := c.lock.take(ctx, unix.LOCK_EX, "claim the node")
	if err != nil {
		return fmt.Errorf("claim the node: %w", err)
	}
	defer unlock()
	if err := c.m.Put(layoutSlotOwner, c.token); err != nil {
		return fmt.Errorf("claim the node: write %s: %w", filepath.Join(c.lock.root, LayoutName), err)
	}
	if then != nil {
		then()
	}
	return nil
}

// Held reports whether no other agent claimed the node since. A failed
// read counts as held: the agent keeps doing its job.
func (c *Claim) Held() bool {
	var v uint32
	if err := c.m.Lookup(layoutSlotOwner, &v); err != nil {
		return true
	}
	return v == c.token
}

// Guard is taken for one change of the enrollment (an attach, a detach, a
// link pin put back): it returns ErrNotHeld if a newer agent holds the
// node, else a release that must be called once the change is done. Guards
// of one agent do not exclude each other; a claim waits for all of them.
// A change must not wait, while it holds a Guard, for another Guard to be
// taken: a claim waiting for the first would hold the second off.
//
// It waits for a claim under way as ClaimNode waits for changes.
func (c *Claim) Guard(ctx context.Context) (release func(), err error) {
	unlock, err := c.lock.take(ctx, unix.LOCK_SH, "change the enrollment")
	if err != nil {
		return nil, err
	}
	if !c.Held() {
		unlock()
		return nil, fmt.Errorf("%w under %s: it attaches, detaches and repairs the pods now", ErrNotHeld, c.lock.root)
	}
	return unlock, nil
}

// Close releases the map; the claim stays recorded.
func (c *Claim) Close() error { return c.m.Close() }

// Release gives the node up as this agent stops, if it still holds it: the
// owner slot is cleared, under the root's exclusive lock (after the
// agent's changes under way). An older agent still running beside it (an
// upgrade rolled back, a new agent that failed its start after claiming)
// then takes the node back (Reclaim); before, it stayed yielded for good,
// and nothing enrolled, detached or repaired the node's pods any more. A
// newer agent's claim is left alone, and any later claim overwrites the
// cleared slot.
func (c *Claim) Release(ctx context.Context) error {
	unlock, err := c.lock.take(ctx, unix.LOCK_EX, "give the node up")
	if err != nil {
		return fmt.Errorf("give the node up: %w", err)
	}
	defer unlock()
	owner, err := c.owner()
	if err != nil || owner != c.token {
		return err
	}
	if err := c.m.Put(layoutSlotOwner, uint32(0)); err != nil {
		return fmt.Errorf("give the node up: write %s: %w", LayoutName, err)
	}
	return nil
}

// Reclaim takes the node back for this agent, which a newer one took it
// from, once that one gave it up (Release) and no other claimed it since.
// It reports whether this agent holds the node again; the caller must read
// the pinned state again (the other agent changed it) before its next
// change. Cheap while the node is held: one map lookup, no lock.
func (c *Claim) Reclaim(ctx context.Context) (bool, error) {
	return c.ReclaimThen(ctx, nil)
}

// ReclaimThen is Reclaim that runs then (if not nil) once the node is taken
// back, under the pin root's exclusive lock, as ClaimNodeThen does: the
// agent reads the pinned state again and points every pinned link back at
// its own programs there, before any change of its own or a newer agent's
// claim. The newer agent swapped its programs into the links as it started
// (loader.Load), and they stayed there after it gave the node up: a
// rollback made for a program bug kept the bug on the pods.
func (c *Claim) ReclaimThen(ctx context.Context, then func()) (bool, error) {
	if owner, err := c.owner(); err != nil || owner != 0 {
		return false, err
	}
	unlock, err := c.lock.take(ctx, unix.LOCK_EX, "take the node back")
	if err != nil {
		return false, fmt.Errorf("take the node back: %w", err)
	}
	defer unlock()
	// Another agent may have claimed it meanwhile.
	if owner, err := c.owner(); err != nil || owner != 0 {
		return false, err
	}
	if err := c.m.Put(layoutSlotOwner, c.token); err != nil {
		return false, fmt.Errorf("take the node back: write %s: %w", LayoutName, err)
	}
	if then != nil {
		then()
	}
	return true, nil
}

// owner is the token of the agent holding the node, 0 if given up.
func (c *Claim) owner() (uint32, error) {
	var v uint32
	if err := c.m.Lookup(layoutSlotOwner, &v); err != nil {
		return 0, fmt.Errorf("read the node's owner in %s: %w", LayoutName, err)
	}
	return v, nil
}

// Quiesce holds off every enrollment change of the agents on the node
// (each runs under Guard's shared lock) until release is called, after
// those under way are done. A loading agent reads the pinned state under
// it before it claims the node: an older agent still attaches and detaches
// pods until then, and state read half-way through one of its changes (a
// pod's veth recorded, its links not pinned yet) is wrong.
//
// It waits for changes under way as ClaimNode does.
func Quiesce(ctx context.Context, root string, log *slog.Logger) (release func(), err error) {
	l := &rootLock{root: root, log: log}
	return l.take(ctx, unix.LOCK_EX, "hold off the enrollment changes")
}

// LockPatience bounds every wait for the pin root's lock. An enrollment
// change holds it for a few netlink and bpf(2) calls, so an agent that holds
// it this long is hung, and a new agent that waited on it in silence would
// never start: it fails instead, naming the holder, and its restart tries
// again.
var LockPatience = 2 * time.Minute

// lockQuietFor is how long a wait for the lock stays unlogged; lockNagEvery
// spaces the reminders after that.
var (
	lockQuietFor = 5 * time.Second
	lockNagEvery = 30 * time.Second
)

// GateName is the directory under the pin root whose flock is the gate in
// front of the root's lock (see rootLock). It is empty; uninstall removes
// it with the pins.
const GateName = "lockgate"

// rootLock takes flock(2) on the pin root directory, through a gate.
//
// flock grants a shared lock whenever only shared locks are held, however
// long an exclusive locker has waited: an agent whose enrollment changes
// overlap without a gap would keep a new agent's claim out until
// LockPatience, and fail its start. So a locker first takes a second
// flock, on the directory GateName, in the same mode: an exclusive locker
// holds the gate until it holds the root, so new shared lockers wait at the
// gate while those already holding the root finish; a shared locker holds
// the gate only until it holds the root.
//
// No deadlock: every locker takes the gate before the root; whoever holds
// the gate waits only for the root, and whoever holds the root waits for
// neither. An exclusive holder (ClaimNode, Quiesce) has let go of the gate
// and takes no other lock; a shared holder's change takes no other Guard
// (see Guard). An agent claims and quiesces before it takes any Guard of
// its own: its exclusive lock would wait for its own changes, gate or not.
//
// An agent from before the gate takes the root lock alone: the root lock
// still excludes as before, only its changes do not give way to a waiting
// claim. A gate that cannot be opened or created is skipped the same way,
// with a warning, once per rootLock (per Claim, for the Guards).
type rootLock struct {
	root       string
	log        *slog.Logger
	gateWarned atomic.Bool
}

// take takes the pin root's lock how (LOCK_SH or LOCK_EX), for what (named
// in its logs), waiting at most LockPatience in all and while ctx lasts;
// the release closes the descriptor, which drops the lock.
func (l *rootLock) take(ctx context.Context, how int, what string) (release func(), err error) {
	fd, err := unix.Open(l.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open pin root %s for locking: %w", l.root, err)
	}
	ctx, cancel := context.WithTimeout(ctx, LockPatience)
	defer cancel()
	w := &lockWait{ctx: ctx, root: l.root, what: what, log: l.log, start: time.Now()}
	w.nextLog = w.start.Add(lockQuietFor)

	gate, err := openGate(l.root)
	if err != nil {
		if !l.gateWarned.Swap(true) && l.log != nil {
			l.log.Warn("pin root lock taken without its gate: a claim may wait for this agent's overlapping enrollment changes",
				"root", l.root, "error", err)
		}
	} else {
		if err := w.flock(gate, how, true); err != nil {
			unix.Close(fd)
			return nil, err
		}
		defer unix.Close(gate) // once the root is held, or not
	}
	if err := w.flock(fd, how, false); err != nil {
		return nil, err
	}
	if waited := time.Since(w.start); waited >= lockQuietFor && l.log != nil {
		l.log.Info("pin root lock taken", "root", l.root, "for", what, "waited", waited.Round(time.Millisecond))
	}
	return func() { unix.Close(fd) }, nil
}

// openGate opens the gate directory under root, creating it as the pin
// tree's directories are (0700, the agent's user; see pin.CheckTree). Not
// following a symlink: the agent makes none there.
func openGate(root string) (int, error) {
	path := filepath.Join(root, GateName)
	const flags = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	fd, err := unix.Open(path, flags, 0)
	if errors.Is(err, unix.ENOENT) {
		if err := unix.Mkdir(path, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
			return -1, fmt.Errorf("create lock gate %s: %w", path, err)
		}
		fd, err = unix.Open(path, flags, 0)
	}
	if err != nil {
		return -1, fmt.Errorf("open lock gate %s: %w", path, err)
	}
	return fd, nil
}

// lockWait is one wait for the pin root's lock: for its gate, then for the
// root itself, within one deadline and with one schedule of logs.
type lockWait struct {
	ctx     context.Context // ends at LockPatience
	root    string
	what    string
	log     *slog.Logger
	start   time.Time
	nextLog time.Time
}

// flock takes flock(2) how on fd, the root's or (gate) its gate's. On
// failure fd is closed, once nothing uses it any more.
//
// flock cannot be interrupted by a context (the Go runtime's signal
// handlers restart it), so a shared lock is polled. An exclusive one is not:
// new shared locks are granted while it waits, so against an agent's
// overlapping changes, with gaps of a millisecond between them, a poll
// every few tens of milliseconds seldom found the lock free, where a waiter
// blocked in the kernel is woken at each release
// (TestExclusiveLockAmidOverlappingGuards: older agents take no gate). It
// blocks on a goroutine of its own, abandoned if the wait ends first; it
// drops the lock if it ever gets it. Only the start of an agent waits for
// the exclusive lock (ClaimNode, Quiesce), so at most twice that many
// threads are held by such waits.
func (w *lockWait) flock(fd, how int, gate bool) error {
	name, waitMsg, hint := "pin root "+w.root, "waiting for the pin root lock: another agent's enrollment change holds it",
		"an agent hung in an enrollment change?"
	if gate {
		name, waitMsg, hint = "the gate of pin root "+w.root, "waiting at the pin root lock's gate: another agent is taking the lock",
			"an agent waiting for a hung one?"
	}
	err := unix.Flock(fd, how|unix.LOCK_NB)
	var blocked chan error // the blocking flock's result (exclusive)
	if err != nil && how == unix.LOCK_EX && errors.Is(err, unix.EWOULDBLOCK) {
		blocked = make(chan error, 1)
		go func() { blocked <- flockRetry(fd, how) }()
	}
	for pause := time.Millisecond; ; pause = min(2*pause, 50*time.Millisecond) {
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			unix.Close(fd)
			return fmt.Errorf("lock %s: %w", name, err)
		}
		if now := time.Now(); !now.Before(w.nextLog) && w.log != nil {
			w.log.Warn(waitMsg, "root", w.root, "for", w.what, "held_by", lockHolders(fd),
				"waited", now.Sub(w.start).Round(time.Second), "gives_up_after", LockPatience)
			w.nextLog = now.Add(lockNagEvery)
		}
		var wake <-chan time.Time // nil: the blocked flock or the end of the wait wakes us
		switch {
		case blocked == nil:
			wake = time.After(pause)
		case w.log != nil:
			wake = time.After(time.Until(w.nextLog)) // the next reminder
		}
		select {
		case <-w.ctx.Done():
			holders := lockHolders(fd)
			if blocked != nil {
				// The blocked flock still uses fd: it closes it, which
				// drops the lock if it got it.
				go func() {
					<-blocked
					unix.Close(fd)
				}()
			} else {
				unix.Close(fd)
			}
			return fmt.Errorf("lock %s: held by %s for over %s (%s): %w",
				name, holders, time.Since(w.start).Round(time.Millisecond), hint, context.Cause(w.ctx))
		case err = <-blocked:
			if err != nil {
				blocked = nil // fd closed at the loop's top, with err named
			}
		case <-wake:
			if blocked == nil {
				err = unix.Flock(fd, how|unix.LOCK_NB)
			}
		}
	}
}

// flockRetry is a blocking flock, retried when interrupted.
func flockRetry(fd, how int) error {
	for {
		err := unix.Flock(fd, how)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// lockHolders names the processes holding a flock on the file open at fd,
// from /proc/locks, for a log or an error. Only holders in our PID
// namespace are listed there.
func lockHolders(fd int) string {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "an unknown process"
	}
	id := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	f, err := os.Open("/proc/locks")
	if err != nil {
		return "an unknown process"
	}
	defer f.Close()
	var names []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// "1: FLOCK  ADVISORY  READ  1234 00:2a:5678 0 EOF"; a waiter's
		// line has "->" after the number.
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 || fields[1] != "FLOCK" || fields[5] != id {
			continue
		}
		if fields[4] == "0" {
			names = append(names, "a process of another PID namespace")
			continue
		}
		name := "pid " + fields[4]
		if comm, err := os.ReadFile("/proc/" + fields[4] + "/comm"); err == nil {
			name += " (" + strings.TrimSpace(string(comm)) + ")"
		}
		names = append(names, name)
	}
	if len(names) == 0 {
		// The kernel leaves out of /proc/locks every lock whose holder is
		// not in the PID namespace of that /proc: the agent of another pod
		// (the chart runs agents without hostPID), the usual holder.
		return "a process in another PID namespace (not listed in /proc/locks here: another agent's pod?), or one that just let go"
	}
	return strings.Join(names, ", ")
}
