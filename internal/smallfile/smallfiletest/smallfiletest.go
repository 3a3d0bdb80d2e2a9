// Package smallfiletest makes the files internal/smallfile refuses, for the
// tests of the code that reads settings' files through it.
package smallfiletest

import (
	"os"
	"strings"
	"syscall"
	"testing"
)

// Fifo makes a fifo at path and returns path: opened or read as a plain
// file, it blocks for ever.
func Fifo(t testing.TB, path string) string {
	t.Helper()
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// Oversized writes size bytes of '0' at path and returns path: a file one
// byte past a reader's bound, whose content would otherwise parse (as an
// integer sysctl, say).
func Oversized(t testing.TB, path string, size int) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(strings.Repeat("0", size)), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
