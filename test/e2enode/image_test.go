//go:build e2enode && linux

package e2enode

import (
	"archive/tar"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestImageMatchesDockerfile checks that hack/build-image.sh builds what the Dockerfile's
// final stage describes: the same entrypoint, command and user, and every file the final
// stage copies in (with the node script executable).
func TestImageMatchesDockerfile(t *testing.T) {
	df, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	// The final stage: everything after the last FROM.
	stages := regexp.MustCompile(`(?m)^FROM `).Split(string(df), -1)
	final := stages[len(stages)-1]
	directive := func(name string) string {
		m := regexp.MustCompile(`(?m)^` + name + ` (.*)$`).FindStringSubmatch(final)
		if m == nil {
			t.Fatalf("Dockerfile's final stage has no %s", name)
		}
		return strings.TrimSpace(m[1])
	}
	var wantEntrypoint, wantCmd []string
	if err := json.Unmarshal([]byte(directive("ENTRYPOINT")), &wantEntrypoint); err != nil {
		t.Fatalf("ENTRYPOINT: %v", err)
	}
	if err := json.Unmarshal([]byte(directive("CMD")), &wantCmd); err != nil {
		t.Fatalf("CMD: %v", err)
	}
	wantUser := directive("USER")
	// COPY [--flags] SRC... DST: with several sources DST is a directory.
	wantFiles := map[string]bool{} // path -> must be executable
	for _, m := range regexp.MustCompile(`(?m)^COPY (.*)$`).FindAllStringSubmatch(final, -1) {
		var args []string
		for _, f := range strings.Fields(m[1]) {
			if !strings.HasPrefix(f, "--") {
				args = append(args, f)
			}
		}
		dst := args[len(args)-1]
		for _, src := range args[:len(args)-1] {
			p := dst
			if strings.HasSuffix(dst, "/") {
				p = path.Join(dst, path.Base(src))
			}
			wantFiles[strings.TrimPrefix(p, "/")] = true
		}
	}
	if len(wantFiles) < 3 {
		t.Fatalf("found only %v in the Dockerfile's COPY lines", wantFiles)
	}

	// The image the node tests run (built once per test binary).
	_, dir := nodeInputs(testContext(t), t)
	config, files := readDockerArchive(t, filepath.Join(dir, "redirector-"+imageTag+".tar"))
	if !slices.Equal(config.Entrypoint, wantEntrypoint) || !slices.Equal(config.Cmd, wantCmd) || config.User != wantUser {
		t.Errorf("image entrypoint %q cmd %q user %q; the Dockerfile says %q %q %q",
			config.Entrypoint, config.Cmd, config.User, wantEntrypoint, wantCmd, wantUser)
	}
	for f := range wantFiles {
		mode, ok := files[f]
		if !ok {
			t.Errorf("image lacks %s, which the Dockerfile copies in", f)
		} else if mode&0o111 == 0 {
			t.Errorf("%s is not executable in the image (mode %o)", f, mode)
		}
	}
	// What the node script runs must be there too (the Dockerfile installs it from Debian).
	for _, tool := range []string{"bin/sh", "bin/dash", "usr/bin/jq", "usr/bin/curl", "usr/bin/stat", "usr/bin/cmp", "usr/bin/mount"} {
		if _, ok := files[tool]; !ok {
			t.Errorf("image lacks %s, which redirector-node needs", tool)
		}
	}
}

type imageConfig struct {
	Entrypoint []string
	Cmd        []string
	User       string
}

// readDockerArchive returns the image config and the files of all layers (path -> mode).
func readDockerArchive(t *testing.T, file string) (imageConfig, map[string]int64) {
	t.Helper()
	blobs := map[string][]byte{}
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		blobs[h.Name] = b
	}
	var manifest []struct {
		Config string
		Layers []string
	}
	if err := json.Unmarshal(blobs["manifest.json"], &manifest); err != nil || len(manifest) != 1 {
		t.Fatalf("manifest.json: %v (%d entries)", err, len(manifest))
	}
	var cfg struct {
		Config imageConfig `json:"config"`
	}
	if err := json.Unmarshal(blobs[manifest[0].Config], &cfg); err != nil {
		t.Fatalf("image config: %v", err)
	}
	files := map[string]int64{}
	for _, l := range manifest[0].Layers {
		lr := tar.NewReader(strings.NewReader(string(blobs[l])))
		for {
			h, err := lr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("layer %s: %v", l, err)
			}
			files[strings.TrimPrefix(path.Clean(h.Name), "/")] = h.Mode
		}
	}
	return cfg.Config, files
}
