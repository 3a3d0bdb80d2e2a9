// Package smallfile reads the small files a setting names (trust bundles,
// CA files, tokens, the kubeconfig, sysctls under PROC_DIR) without
// trusting what is at the path: a fifo there would block the read for ever,
// a device such as /dev/zero or a huge file would fill the memory.
package smallfile

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// Read returns the contents of the regular file at path, at most limit
// bytes. A path that holds no regular file (a directory, fifo, device or
// socket), or a file over limit, is an error naming the path. The file is
// opened without blocking (a fifo would wait for a writer) and checked
// after opening, so what is checked is what is read.
func Read(path string, limit int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file (%s)", path, Kind(fi.Mode()))
	}
	if fi.Size() > limit {
		return nil, fmt.Errorf("%s has %d bytes, more than the %d read", path, fi.Size(), limit)
	}
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s has more than the %d bytes read", path, limit)
	}
	return data, nil
}

// Kind names a file's type for an error.
func Kind(m fs.FileMode) string {
	switch {
	case m.Type() == 0:
		return "a regular file"
	case m.IsDir():
		return "a directory"
	case m&fs.ModeSymlink != 0:
		return "a symbolic link"
	case m&fs.ModeNamedPipe != 0:
		return "a fifo"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeDevice != 0:
		return "a device"
	}
	return "mode " + m.String()
}
