package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/redirector-mesh/redirector/pkg/loader"
)

// runUninstall removes every pod's programs, rules and routes and every pin
// the agent made. It removes nothing it did not create: a --bpf-root that
// is not on a bpffs is refused, and others' entries under it stay.
func runUninstall(ctx context.Context, args []string) error {
	root, procDir, err := parseUninstallFlags(args)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	data := loader.DefaultSettings()
	data.ProcDir = procDir
	if err := loader.Uninstall(ctx, root, data, log); err != nil {
		return fmt.Errorf("uninstall %s: %w", root, err)
	}
	if _, err := os.Stat(root); err == nil {
		fmt.Printf("uninstalled: the agent's pins are gone; %s stays, it holds entries the agent did not create\n", root)
		return nil
	}
	fmt.Printf("uninstalled: %s removed\n", root)
	return nil
}

// parseUninstallFlags reads uninstall's settings: the same two directories
// as the agent's, absolute and clean as there.
func parseUninstallFlags(args []string) (root, procDir string, err error) {
	s := newSettings("uninstall")
	r := s.add("bpf-root", "BPF_ROOT", loader.DefaultPinRoot, "where the agent pinned its maps and links")
	p := s.add("proc-dir", "PROC_DIR", "/proc", "a writable procfs: pods' sysctls are restored under <dir>/sys (the Helm chart mounts the host's /proc at /host/proc)")
	if err := s.parse(args); err != nil {
		return "", "", err
	}
	if err := s.checkPaths(r, p); err != nil {
		return "", "", err
	}
	return *r, *p, nil
}
