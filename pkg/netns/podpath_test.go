package netns

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/internal/smallfile/smallfiletest"
	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// TestCheckPodPath: only an absolute, clean path to a network namespace
// other than the agent's and pid 1's passes, and its inode is returned;
// every refusal names the path.
func TestCheckPodPath(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	pod := testNS(t, fmt.Sprintf("rdpp%04x", rand.IntN(0xffff)), "10.213.0.2/24")
	ino, err := CheckPodPath(pod, "")
	if want, _ := Inode(pod); err != nil || ino != want {
		t.Fatalf("CheckPodPath(%s) = %d, %v; want %d", pod, ino, err, want)
	}
	dir := t.TempDir()
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	self := filepath.Join(dir, "self")
	if err := os.Symlink("/proc/self/ns/net", self); err != nil {
		t.Fatal(err)
	}
	paths := []string{
		"/proc/self/ns/net", "/proc/thread-self/ns/net", self,
		"/proc/self/ns/mnt", // a namespace, not a network one
		plain,               // not a namespace
		"var/run/netns/x",   // relative
		"/var/run/netns/../netns/" + filepath.Base(pod), // not clean
	}
	if _, err := Inode("/proc/1/ns/net"); err == nil {
		paths = append(paths, "/proc/1/ns/net") // not readable in some containers
	}
	for _, path := range paths {
		if _, err := CheckPodPath(path, ""); !errors.Is(err, ErrNotPodNetNS) {
			t.Errorf("CheckPodPath(%q) = %v; want ErrNotPodNetNS", path, err)
		} else if !containsStr(err.Error(), path) {
			t.Errorf("CheckPodPath(%q): error %q does not name the path", path, err)
		}
	}
	if _, err := CheckPodPath(filepath.Join(dir, "missing"), ""); err == nil {
		t.Errorf("a missing path passed")
	}
}

func containsStr(s, sub string) bool { return strings.Contains(s, sub) }

// TestCheckPodPathFifo: a fifo at a reported path is refused at once, naming
// it, by CheckPodPath and Open (os.Open waited for a writer for ever).
func TestCheckPodPathFifo(t *testing.T) {
	fifo := smallfiletest.Fifo(t, filepath.Join(t.TempDir(), "fifo"))
	for what, open := range map[string]func() error{
		"CheckPodPath(fifo)": func() error { _, err := CheckPodPath(fifo, ""); return err },
		"Open(fifo)":         func() error { _, err := Open(fifo); return err },
	} {
		if err := waitfor.Returns(t, what, open); err == nil || !strings.Contains(err.Error(), fifo+": not a namespace file") {
			t.Errorf("%s = %v, want an error naming %s as not a namespace file", what, err, fifo)
		}
	}
}
