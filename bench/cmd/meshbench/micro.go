package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// microResult is one line of `go test -bench` output.
type microResult struct {
	Pkg        string             `json:"pkg"`
	Name       string             `json:"name"`
	Iterations int64              `json:"iterations"`
	Metrics    map[string]float64 `json:"metrics"` // unit -> value: ns/op, B/op, allocs/op, MB/s, ...
}

// runMicro runs the Go microbenchmarks of ./pkg/... with -benchmem, keeps
// the raw output in rawFile, and parses it. Only packages that define a
// benchmark are passed to go test: the same results as ./pkg/..., without
// linking a test binary for every other package.
func runMicro(ctx context.Context, cfg config, rawFile string) ([]microResult, error) {
	pkgs, err := benchPackages(cfg.Repo)
	if err != nil {
		return nil, err
	}
	args := append([]string{"test", "-run", "^$", "-bench", ".", "-benchmem", "-count", "1",
		"-benchtime", cfg.BenchTime, "-timeout", "20m"}, pkgs...)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = cfg.Repo
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	runErr := cmd.Run()
	if err := os.WriteFile(rawFile, out.Bytes(), 0o644); err != nil {
		return nil, err
	}
	res := parseBench(out.String())
	if runErr != nil {
		return res, fmt.Errorf("go %s: %w (output in %s)", strings.Join(args, " "), runErr, rawFile)
	}
	return res, nil
}

// benchPackages lists ./pkg/... directories whose tests define a Benchmark.
func benchPackages(repo string) ([]string, error) {
	var pkgs []string
	err := filepath.WalkDir(filepath.Join(repo, "pkg"), func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return err
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if bytes.Contains(src, []byte("\nfunc Benchmark")) {
			rel, _ := filepath.Rel(repo, filepath.Dir(path))
			if p := "./" + rel; !slices.Contains(pkgs, p) {
				pkgs = append(pkgs, p)
			}
		}
		return nil
	})
	if err == nil && len(pkgs) == 0 {
		err = fmt.Errorf("no benchmarks under %s/pkg", repo)
	}
	return pkgs, err
}

var benchLine = regexp.MustCompile(`^(Benchmark\S+?)(?:-\d+)?\s+(\d+)\s+(.*)$`)

func parseBench(out string) []microResult {
	var res []microResult
	pkg := ""
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if p, ok := strings.CutPrefix(line, "pkg: "); ok {
			pkg = strings.TrimSpace(p)
			continue
		}
		m := benchLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		n, _ := strconv.ParseInt(m[2], 10, 64)
		r := microResult{Pkg: pkg, Name: m[1], Iterations: n, Metrics: map[string]float64{}}
		f := strings.Fields(m[3])
		for i := 0; i+1 < len(f); i += 2 {
			if v, err := strconv.ParseFloat(f[i], 64); err == nil {
				r.Metrics[f[i+1]] = v
			}
		}
		res = append(res, r)
	}
	return res
}
