package manifests

import (
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
)

// repoRoot is the build context of the Dockerfile: the main module, one level up.
const repoRoot = ".."

// imageBinDir is where the image puts every program the chart runs.
const imageBinDir = "/usr/local/bin/"

// dockerfile is the parsed Dockerfile: its stages and the linter's warnings.
type dockerfile struct {
	stages   []instructions.Stage
	warnings []string
}

func parseDockerfile(t *testing.T) dockerfile {
	t.Helper()
	f, err := os.Open(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ast, err := parser.Parse(f)
	if err != nil {
		t.Fatalf("parse Dockerfile: %v", err)
	}
	var d dockerfile
	for _, w := range ast.Warnings {
		d.warnings = append(d.warnings, w.Short)
	}
	lint := linter.New(&linter.Config{Warn: func(rule, _, _, msg string, loc []parser.Range) {
		d.warnings = append(d.warnings, fmt.Sprintf("%s: %s (line %v)", rule, msg, loc))
	}})
	d.stages, _, err = instructions.Parse(ast.AST, lint)
	if err != nil {
		t.Fatalf("Dockerfile instructions: %v", err)
	}
	return d
}

// commands returns the stage's commands of type T.
func commands[T instructions.Command](s instructions.Stage) []T {
	var out []T
	for _, c := range s.Commands {
		if v, ok := c.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

func TestDockerfileLints(t *testing.T) {
	if d := parseDockerfile(t); len(d.warnings) > 0 {
		t.Errorf("Dockerfile warnings:\n%s", strings.Join(d.warnings, "\n"))
	}
}

// buildPackages returns the packages the build stage's `go build` compiles.
func buildPackages(t *testing.T, build instructions.Stage) []string {
	t.Helper()
	for _, run := range commands[*instructions.RunCommand](build) {
		line := strings.Join(run.CmdLine, " ")
		if _, args, ok := strings.Cut(line, "go build"); ok {
			var pkgs []string
			for _, f := range strings.Fields(args) {
				if strings.HasPrefix(f, "./cmd/") {
					pkgs = append(pkgs, f)
				}
			}
			return pkgs
		}
	}
	t.Fatal("no RUN ... go build in the build stage")
	return nil
}

func TestDockerfileStages(t *testing.T) {
	d := parseDockerfile(t)
	if len(d.stages) < 2 {
		t.Fatalf("%d stage(s): want a build stage and a final stage", len(d.stages))
	}
	build, final := d.stages[0], d.stages[len(d.stages)-1]
	if build.Name != "build" || !strings.HasPrefix(build.BaseName, "golang:") {
		t.Errorf("first stage %q FROM %q, want build FROM golang:...", build.Name, build.BaseName)
	}

	// Static binaries: cgo off for every go command of the build stage.
	cgoOff := false
	for _, e := range commands[*instructions.EnvCommand](build) {
		for _, kv := range e.Env {
			if kv.Key == "CGO_ENABLED" {
				cgoOff = kv.Value == "0"
			}
		}
	}
	if !cgoOff {
		t.Error("the build stage does not set ENV CGO_ENABLED=0")
	}
	pkgs := buildPackages(t, build)
	for _, want := range []string{"./cmd/redirector", "./cmd/redirector-cni"} {
		if !slices.Contains(pkgs, want) {
			t.Errorf("go build compiles %v, not %s", pkgs, want)
		}
	}

	// The final stage: small, not the Go toolchain, and carrying both binaries and the script.
	if strings.HasPrefix(final.BaseName, "golang") || final.BaseName == build.Name {
		t.Errorf("final stage FROM %q: the toolchain would ship in the image", final.BaseName)
	}
	copied := map[string]string{} // file name in the image -> source
	for _, c := range commands[*instructions.CopyCommand](final) {
		if !strings.HasSuffix(c.DestPath, "/") {
			copied[c.DestPath] = c.From + ":" + strings.Join(c.SourcePaths, ",")
			continue
		}
		for _, src := range c.SourcePaths {
			copied[c.DestPath+filepath.Base(src)] = c.From + ":" + src
		}
	}
	for bin, from := range map[string]string{
		imageBinDir + "redirector":      "build:/out/redirector",
		imageBinDir + "redirector-cni":  "build:/out/redirector-cni",
		imageBinDir + "redirector-node": ":manifests/image/redirector-node",
	} {
		if copied[bin] != from {
			t.Errorf("final stage: %s comes from %q, want %q", bin, copied[bin], from)
		}
	}

	eps := commands[*instructions.EntrypointCommand](final)
	if len(eps) != 1 || eps[0].PrependShell || !slices.Equal(eps[0].CmdLine, []string{imageBinDir + "redirector"}) {
		t.Errorf("ENTRYPOINT %+v, want exec form [%sredirector]", eps, imageBinDir)
	}
	cmds := commands[*instructions.CmdCommand](final)
	if len(cmds) != 1 || !slices.Equal(cmds[0].CmdLine, []string{"run"}) {
		t.Errorf("CMD %+v, want [run]", cmds)
	}
	users := commands[*instructions.UserCommand](final)
	if len(users) == 0 || !strings.HasPrefix(users[len(users)-1].User, "0") {
		t.Errorf("USER %+v: the image must say it runs as root (capabilities need uid 0)", users)
	}
}

// TestChartRunsWhatTheImageHas: every program the chart's containers start is one the
// Dockerfile puts on the PATH, and the agent container relies on the image's entrypoint.
func TestChartRunsWhatTheImageHas(t *testing.T) {
	d := parseDockerfile(t)
	final := d.stages[len(d.stages)-1]
	have := map[string]bool{}
	for _, c := range commands[*instructions.CopyCommand](final) {
		for _, src := range c.SourcePaths {
			if strings.HasPrefix(c.DestPath, imageBinDir) {
				have[filepath.Base(src)] = true
			}
		}
	}
	ds := mustRender(t, renderOpts{}).DaemonSet
	spec := ds.Spec.Template.Spec
	for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
		if len(c.Command) == 0 {
			if c.Name != "agent" || !slices.Equal(c.Args, []string{"run"}) {
				t.Errorf("%s: no command and args %v", c.Name, c.Args)
			}
			continue
		}
		if !have[c.Command[0]] {
			t.Errorf("%s runs %q, which the image does not have in %s", c.Name, c.Command[0], imageBinDir)
		}
	}
}

// dockerignore returns a matcher of the paths .dockerignore keeps out of the build context.
func dockerignore(t *testing.T) *patternmatcher.PatternMatcher {
	t.Helper()
	f, err := os.Open(filepath.Join(repoRoot, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	patterns, err := ignorefile.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	pm, err := patternmatcher.New(patterns)
	if err != nil {
		t.Fatal(err)
	}
	return pm
}

// contextFiles walks the repository as `docker build .` sends it: the files .dockerignore
// does not exclude, by path relative to the root.
func contextFiles(t *testing.T) []string {
	t.Helper()
	pm := dockerignore(t)
	var files []string
	err := filepath.WalkDir(repoRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(repoRoot, path)
		if rel == "." {
			return nil
		}
		rel = filepath.ToSlash(rel)
		excluded, err := pm.MatchesOrParentMatches(rel)
		if err != nil {
			return err
		}
		switch {
		case d.IsDir() && excluded && !reincludesBelow(pm, rel):
			return filepath.SkipDir
		case !d.IsDir() && !excluded && d.Type().IsRegular():
			files = append(files, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// reincludesBelow reports whether a "!pattern" of the matcher may bring back a path below the
// excluded directory dir, so the walk must enter it.
func reincludesBelow(pm *patternmatcher.PatternMatcher, dir string) bool {
	for _, p := range pm.Patterns() {
		if p.Exclusion() && strings.HasPrefix(p.String(), dir+"/") {
			return true
		}
	}
	return false
}

func TestDockerignore(t *testing.T) {
	files := contextFiles(t)
	in := map[string]bool{}
	for _, f := range files {
		in[f] = true
	}
	// What the build needs: the module files, every non-test file of the agent's packages
	// (the committed eBPF objects included), and the node script.
	for _, must := range []string{"go.mod", "go.sum", "manifests/image/redirector-node", "bpf/capture_bpfel.o", "cmd/redirector/main.go"} {
		if !in[must] {
			t.Errorf(".dockerignore excludes %s, which the build needs", must)
		}
	}
	for _, dir := range []string{"bpf", "cmd", "pkg", "internal"} {
		_ = filepath.WalkDir(filepath.Join(repoRoot, dir), func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || strings.HasSuffix(path, "_test.go") || strings.Contains(path, "/testdata/") {
				return nil
			}
			rel, _ := filepath.Rel(repoRoot, path)
			if !in[filepath.ToSlash(rel)] {
				t.Errorf(".dockerignore excludes %s", rel)
			}
			return nil
		})
	}
	// What it must not send: history, build output, the chart and tests.
	for _, f := range files {
		for _, prefix := range []string{".git/", "bin/", "manifests/charts/", "test/", "docs/"} {
			if strings.HasPrefix(f, prefix) {
				t.Errorf("build context includes %s", f)
			}
		}
		if strings.HasSuffix(f, "_test.go") {
			t.Errorf("build context includes test file %s", f)
		}
	}
}

// TestImageContextBuilds builds the Dockerfile's packages from the files of the build context
// alone (what .dockerignore lets through), as the build stage does, and checks that the
// binaries are static. It compiles the agent, so -short skips it.
func TestImageContextBuilds(t *testing.T) {
	if testing.Short() {
		t.Skip("compiles the agent; skipped with -short")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	dir := t.TempDir()
	for _, f := range contextFiles(t) {
		if err := copyFile(filepath.Join(repoRoot, f), filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	d := parseDockerfile(t)
	var built, missing []string
	for _, pkg := range buildPackages(t, d.stages[0]) {
		if goFiles, _ := filepath.Glob(filepath.Join(dir, pkg, "*.go")); len(goFiles) == 0 {
			missing = append(missing, pkg)
			continue
		}
		out := filepath.Join(t.TempDir(), filepath.Base(pkg))
		cmd := exec.Command(goBin, "build", "-trimpath", "-o", out, pkg)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=readonly")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("go build %s from the build context: %v\n%s", pkg, err, b)
			continue
		}
		if interp, err := hasInterpreter(out); err != nil || interp {
			t.Errorf("%s is not a static binary (dynamic loader %v, %v)", pkg, interp, err)
		}
		built = append(built, pkg)
	}
	t.Logf("built %v from the build context", built)
	if len(missing) > 0 {
		t.Skipf("%v have no Go files yet: the image cannot build until they do", missing)
	}
}

func copyFile(src, dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	return errors.Join(err, out.Close())
}

// hasInterpreter reports whether an ELF binary asks for a dynamic loader (PT_INTERP).
func hasInterpreter(path string) (bool, error) {
	f, err := elf.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return true, nil
		}
	}
	return false, nil
}
