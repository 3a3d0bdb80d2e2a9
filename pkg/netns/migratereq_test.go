package netns

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/internal/smallfile/smallfiletest"
	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// TestEnableMigrateReqBounded: the sysctl under procDir (a setting) is read
// through smallfile. A fifo there fails at once naming it (os.ReadFile
// blocked a thread in the namespace for ever); an outsized file is refused
// naming the limit.
func TestEnableMigrateReqBounded(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	pod := testNS(t, fmt.Sprintf("rdmr%04x", rand.IntN(0xffff)))
	fifoDir, bigDir := t.TempDir(), t.TempDir()
	for _, d := range []string{fifoDir, bigDir} {
		if err := os.MkdirAll(filepath.Join(d, "sys/net/ipv4"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	fifo := smallfiletest.Fifo(t, filepath.Join(fifoDir, migrateReqPath))
	big := smallfiletest.Oversized(t, filepath.Join(bigDir, migrateReqPath), maxSysctlBytes+1)
	for procDir, want := range map[string]string{
		fifoDir: fifo + " is not a regular file (a fifo)",
		bigDir:  fmt.Sprintf("%s has %d bytes, more than the %d read", big, maxSysctlBytes+1, maxSysctlBytes),
	} {
		err := waitfor.Returns(t, "EnableMigrateReq("+procDir+")", func() error { _, err := EnableMigrateReq(pod, procDir); return err })
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("EnableMigrateReq(%s) = %v, want %q", procDir, err, want)
		}
	}
}
