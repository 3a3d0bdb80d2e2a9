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
	"io"
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
	if os.Getenv("CNI_COMMAND") == "DEL" {
		// skel checks the configuration's JSON and CNI version before it
		// calls Del, and fails the DEL when they are wrong; a DEL must
		// never fail (the runtime repeats it for ever, and the pod stays
		// Terminating), whatever conflist the plugin was chained into.
		_ = p.del(delArgs(os.Stdin))
		return
	}
	skel.PluginMainFuncs(p.funcs(),
		version.PluginSupports(supportedVersions...),
		"redirector-cni: enrolls new pods in the redirector ambient mesh")
}

// supportedVersions are the CNI versions the plugin's configuration may have.
var supportedVersions = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// delArgs builds DEL's arguments from the CNI environment and stdin as skel
// would, without its checks; stdin is read up to 1 MiB.
func delArgs(stdin io.Reader) *skel.CmdArgs {
	data, _ := io.ReadAll(io.LimitReader(stdin, 1<<20))
	return &skel.CmdArgs{
		ContainerID: os.Getenv("CNI_CONTAINERID"),
		Netns:       os.Getenv("CNI_NETNS"),
		IfName:      os.Getenv("CNI_IFNAME"),
		Args:        os.Getenv("CNI_ARGS"),
		Path:        os.Getenv("CNI_PATH"),
		StdinData:   data,
	}
}
