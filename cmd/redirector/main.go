// Command redirector is the node agent of an eBPF ambient-mesh dataplane:
// it redirects enrolled pods' TCP into its own mTLS (HBONE) tunnel.
//
//	redirector run --node-name NAME --source file:PATH|kubernetes --ca-dir DIR [...]
//	redirector ca init --dir DIR [--trust-domain cluster.local]
//	redirector uninstall [--bpf-root PATH]
//	redirector inspect pods|maps|certs|policies [-o table|json|yaml]
//	redirector version
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

const usage = `usage:
  redirector run --node-name NAME --source file:PATH|kubernetes --ca-dir DIR [flags]
  redirector ca init --dir DIR [--trust-domain cluster.local]
  redirector uninstall [--bpf-root PATH]
  redirector inspect pods|maps|certs|policies [-o table|json|yaml]
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
	case "version":
		fmt.Println("redirector", version)
		return nil
	case "-h", "--help", "help":
		fmt.Println(usage)
		return nil
	default:
		fmt.Fprintln(os.Stderr, usage)
		return fmt.Errorf("unknown command %q", cmd)
	}
}
