package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/redirector-mesh/redirector/pkg/loader"
)

// runUninstall removes every pod's programs, rules and routes and every pin.
func runUninstall(ctx context.Context, args []string) error {
	s := newSettings("uninstall")
	root := s.add("bpf-root", "BPF_ROOT", loader.DefaultPinRoot, "where the agent pinned its maps and links")
	if err := s.parse(args); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := loader.Uninstall(ctx, *root, loader.DefaultSettings(), log); err != nil {
		return fmt.Errorf("uninstall %s: %w", *root, err)
	}
	fmt.Printf("uninstalled: nothing left under %s\n", *root)
	return nil
}
