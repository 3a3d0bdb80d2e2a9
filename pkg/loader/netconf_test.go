package loader

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/internal/smallfile/smallfiletest"
	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// TestReadSysctlBounded: a sysctl under ProcDir (a setting) is read through
// smallfile. A fifo there fails at once naming it (os.ReadFile blocked for
// ever); an outsized file is refused naming the limit.
func TestReadSysctlBounded(t *testing.T) {
	dir := t.TempDir()
	fifo := smallfiletest.Fifo(t, filepath.Join(dir, "fifo"))
	big := smallfiletest.Oversized(t, filepath.Join(dir, "big"), maxSysctlBytes+1)
	ok := filepath.Join(dir, "ok")
	if err := os.WriteFile(ok, []byte("2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if v, err := readSysctl(ok); err != nil || v != 2 {
		t.Errorf("readSysctl(ok) = %d, %v; want 2", v, err)
	}
	for path, want := range map[string]string{
		fifo: fifo + " is not a regular file (a fifo)",
		big:  fmt.Sprintf("%s has %d bytes, more than the %d read", big, maxSysctlBytes+1, maxSysctlBytes),
	} {
		err := waitfor.Returns(t, "readSysctl("+path+")", func() error { _, err := readSysctl(path); return err })
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("readSysctl(%s) = %v, want %q", path, err, want)
		}
	}
}

// TestWriteSysctlFifo: the attach writes accept_local and rp_filter even when
// reading their old values failed, so the write must not block on a fifo
// either (os.WriteFile waited for a reader for ever).
func TestWriteSysctlFifo(t *testing.T) {
	fifo := smallfiletest.Fifo(t, filepath.Join(t.TempDir(), "fifo"))
	if err := waitfor.Returns(t, "writeSysctl(fifo)", func() error { return writeSysctl(fifo, 1) }); err == nil || !strings.Contains(err.Error(), "write "+fifo) {
		t.Errorf("writeSysctl(fifo) = %v, want an error naming it", err)
	}
	ok := filepath.Join(t.TempDir(), "ok")
	if err := writeSysctl(ok, 7); err != nil {
		t.Fatal(err)
	}
	if v, err := readSysctl(ok); err != nil || v != 7 {
		t.Errorf("read back %d, %v; want 7", v, err)
	}
}
