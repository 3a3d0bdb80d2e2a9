package maps

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cilium/ebpf"
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
func CheckLayout(root string) error {
	want := LayoutVersion()
	got, pinned, err := readLayout(root)
	if err != nil {
		return err
	}
	if !pinned {
		if _, err := os.Stat(filepath.Join(root, PodsName)); err != nil {
			return nil // a fresh root
		}
		got = 1
	}
	if got == want {
		return nil
	}
	return fmt.Errorf("%w: the maps pinned under %s have layout version %d, this agent reads layout %d and does not "+
		"migrate them. The pods stay redirected by the programs pinned there (fail closed while no agent of layout %d "+
		"serves them). Either run a release with layout %d on this node, or drain the node, run `redirector uninstall "+
		"--bpf-root %s` (its pods are not redirected until this agent enrolls them again) and start this agent",
		ErrLayout, root, got, want, got, got, root)
}

// PinLayout records this build's layout version under root (after the
// maps were loaded or created there).
func PinLayout(root string) error {
	path := filepath.Join(root, LayoutName)
	m, err := ebpf.LoadPinnedMap(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		m, err = ebpf.NewMap(&ebpf.MapSpec{Name: LayoutName, Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 2})
		if err == nil {
			if err = m.Pin(path); err != nil {
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
	return v, true, nil
}

// Claim is an agent's hold on the node's pinned state. Two agents overlap
// during an upgrade; only the newest may change the enrollment (attach,
// detach, repair), or the two would race on the same pods. The older one
// sees Held turn false and only serves the pods it has until it drains.
type Claim struct {
	m     *ebpf.Map
	token uint32
}

// ClaimNode makes the caller the agent that holds the node under root (the
// maps must be loaded there, Load pins rd_layout). Close releases the map.
func ClaimNode(root string) (*Claim, error) {
	path := filepath.Join(root, LayoutName)
	m, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		return nil, fmt.Errorf("claim the node: open %s: %w", path, err)
	}
	var b [4]byte
	c := &Claim{m: m}
	for c.token == 0 {
		if _, err := rand.Read(b[:]); err != nil {
			m.Close()
			return nil, fmt.Errorf("claim the node: %w", err)
		}
		c.token = binary.LittleEndian.Uint32(b[:])
	}
	if err := m.Put(layoutSlotOwner, c.token); err != nil {
		m.Close()
		return nil, fmt.Errorf("claim the node: write %s: %w", path, err)
	}
	return c, nil
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

// Close releases the map; the claim stays recorded.
func (c *Claim) Close() error { return c.m.Close() }
