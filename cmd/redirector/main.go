// Command redirector is the node agent of an eBPF ambient-mesh dataplane:
// it redirects enrolled pods' TCP into its own mTLS (HBONE) tunnel.
//
//	redirector run --node-name NAME --source file:PATH|kubernetes --ca-dir DIR [...]
//	redirector ca init --dir DIR [--trust-domain cluster.local]
//	redirector uninstall [--bpf-root PATH]
//	redirector inspect pods|maps|workloads|services|certs|policies [-o table|json|yaml]
//	redirector ready --socket PATH
//	redirector version
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"syscall"
)

// Build information, set at build time by the Makefile and the image build:
//
//	-ldflags "-X main.version=... -X main.commit=... -X main.buildDate=..."
//
// Without them, commit and date come from the Go toolchain's VCS stamp if
// the build had one.
var (
	version   = "dev"
	commit    = ""
	buildDate = ""
)

const usage = `usage:
  redirector run --node-name NAME --source file:PATH|kubernetes --ca-dir DIR [flags]
  redirector ca init --dir DIR [--trust-domain cluster.local]
  redirector uninstall [--bpf-root PATH]
  redirector inspect pods|maps|workloads|services|certs|policies [-o table|json|yaml]
  redirector version
Run "redirector <command> -h" for the flags of a command.`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := dispatch(ctx, os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "redirector:", err)
		os.Exit(1)
	}
}

func dispatch(ctx context.Context, args []string) error {
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, usage)
		return fmt.Errorf("no command given")
	}
	switch cmd, rest := args[0], args[1:]; cmd {
	case "run":
		return runAgent(ctx, rest)
	case "ca":
		return runCA(rest)
	case "uninstall":
		return runUninstall(ctx, rest)
	case "inspect":
		return runInspect(ctx, rest)
	case "ready":
		return runReady(ctx, rest)
	case "version":
		s := newSettings("version")
		if err := s.parse(rest); err != nil {
			return err
		}
		fmt.Print(versionText())
		return nil
	case "-h", "--help", "help":
		fmt.Println(usage)
		return nil
	default:
		fmt.Fprintln(os.Stderr, usage)
		return fmt.Errorf("unknown command %q", cmd)
	}
}

// versionText is what `redirector version` prints: the version, the commit
// and date it was built from, and the Go toolchain.
func versionText() string {
	c, d := commit, buildDate
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, kv := range info.Settings {
			switch {
			case kv.Key == "vcs.revision" && c == "":
				c = kv.Value
			case kv.Key == "vcs.time" && d == "":
				d = kv.Value
			}
		}
	}
	return fmt.Sprintf("redirector %s\n  commit:     %s\n  built:      %s\n  go:         %s\n  platform:   %s/%s\n",
		version, orUnknown(c), orUnknown(d), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}
