// Command redirector-cni is a chained CNI plugin that tells the redirector
// agent about pod sandboxes as the container runtime creates and deletes
// them. It must be the last plugin of the pod network's conflist: it needs the
// previous plugins' result (the pod's addresses) and passes it on unchanged.
//
// Its configuration entry:
//
//	{"type": "redirector-cni",
//	 "agentSocket": "/var/run/redirector/cni.sock",
//	 "selectionHint": "/var/run/redirector/ambient-namespaces.json"}
//
// both fields optional (those are the defaults). ADD waits for the agent to
// enroll a selected pod before the runtime starts its containers; see
// plugin.verdict for what happens when the agent cannot be reached.
package main

import (
	"log/slog"
	"os"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/redirector-mesh/redirector/pkg/cni"
)

func main() {
	// stdout carries the CNI result only; diagnostics go to stderr, which
	// runtimes record in their own logs.
	p := &plugin{
		stdout: os.Stdout,
		log:    slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).With("plugin", "redirector-cni"),
		notify: cni.Notify,
	}
	skel.PluginMainFuncs(p.funcs(),
		version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"),
		"redirector-cni: enrolls new pods in the redirector ambient mesh")
}
