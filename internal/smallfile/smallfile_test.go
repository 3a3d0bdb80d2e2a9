package smallfile

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/internal/smallfile/smallfiletest"
)

func TestRead(t *testing.T) {
	dir := t.TempDir()
	ok := filepath.Join(dir, "ok")
	if err := os.WriteFile(ok, []byte("abc"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := Read(ok, 3); err != nil || string(b) != "abc" {
		t.Fatalf("Read(ok) = %q, %v", b, err)
	}
	fifo := smallfiletest.Fifo(t, filepath.Join(dir, "fifo"))
	for path, want := range map[string]string{
		ok:          "has 3 bytes, more than the 2 read",
		fifo:        "is not a regular file (a fifo)",
		dir:         "is not a regular file (a directory)",
		"/dev/zero": "is not a regular file (a device)",
	} {
		if _, err := Read(path, 2); err == nil || !strings.Contains(err.Error(), path+" "+want) {
			t.Errorf("Read(%s) = %v, want %q", path, err, want)
		}
	}
}
