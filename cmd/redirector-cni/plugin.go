package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/redirector-mesh/redirector/pkg/cni"
)

// How long each command waits for the agent. ADD waits longest: the agent
// answers only once the pod is enrolled. DEL and CHECK only look things up or
// tear down, and a DEL that hangs holds up the runtime's cleanup.
const (
	addTimeout   = cni.DefaultNotifyTimeout
	delTimeout   = 10 * time.Second
	checkTimeout = 10 * time.Second
)

// netConf is the plugin's entry in the conflist. There is deliberately no
// "fail open" switch: a selected pod must never start unmeshed.
type netConf struct {
	types.PluginConf
	// AgentSocket is the agent's unix socket (cni.DefaultSocketPath).
	AgentSocket string `json:"agentSocket,omitempty"`
	// SelectionHint is the file the agent keeps its namespace selection in
	// (cni.DefaultHintPath), read only while the agent is unreachable.
	SelectionHint string `json:"selectionHint,omitempty"`

	// rawPrevResult is prevResult exactly as the runtime sent it, printed
	// back as this plugin's result: re-encoding the parsed form would drop
	// fields this library version does not know and empty ones it omits.
	rawPrevResult json.RawMessage
}

// plugin carries what the commands need from outside, so that tests can
// swap the output and the logger.
type plugin struct {
	stdout io.Writer
	log    *slog.Logger
	notify func(ctx context.Context, socketPath string, ev cni.PodEvent) (cni.Response, error)
}

func (p *plugin) funcs() skel.CNIFuncs {
	// GC and STATUS are left to skel (success): the agent collects its own
	// garbage, and an agent that is down must not mark the node unready,
	// since pods outside the mesh can still start.
	return skel.CNIFuncs{Add: p.add, Del: p.del, Check: p.check}
}

// add forwards the new pod to the agent and, unless that forbids it, passes
// the previous plugins' result through unchanged: this plugin adds no
// interface and no address.
func (p *plugin) add(args *skel.CmdArgs) error {
	conf, err := parseConf(args.StdinData)
	if err != nil {
		return err
	}
	if conf.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig,
			"redirector-cni must be chained after the plugin that creates the pod's interface: no prevResult in its configuration", "")
	}
	ev, ok, err := podEvent(cni.CommandAdd, args, conf.PrevResult)
	if err != nil {
		return err
	}
	if ok {
		ctx, cancel := context.WithTimeout(context.Background(), addTimeout)
		defer cancel()
		resp, err := p.notify(ctx, conf.AgentSocket, ev)
		if err := p.verdict(conf, ev, resp, err); err != nil {
			return err
		}
	}
	if _, err := p.stdout.Write(append(conf.rawPrevResult, '\n')); err != nil {
		return types.NewError(types.ErrIOFailure, fmt.Sprintf("print result: %v", err), "")
	}
	return nil
}

// check asks the agent whether the pod is as it should be.
func (p *plugin) check(args *skel.CmdArgs) error {
	conf, err := parseConf(args.StdinData)
	if err != nil {
		return err
	}
	ev, ok, err := podEvent(cni.CommandCheck, args, conf.PrevResult)
	if err != nil || !ok {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), checkTimeout)
	defer cancel()
	resp, err := p.notify(ctx, conf.AgentSocket, ev)
	return p.verdict(conf, ev, resp, err)
}

// del tells the agent the pod is going, best effort. It never fails: the
// runtime repeats a failed DEL forever, and the agent drops pods whose
// sandbox is gone on its own (its reconcile follows the pod list).
func (p *plugin) del(args *skel.CmdArgs) error {
	conf, err := parseConf(args.StdinData)
	if err != nil {
		p.log.Warn("DEL: ignoring unreadable configuration", "container", args.ContainerID, "error", err)
		return nil
	}
	ev, ok, err := podEvent(cni.CommandDel, args, conf.PrevResult)
	if err != nil || !ok {
		if err != nil {
			p.log.Warn("DEL: not telling the agent", "container", args.ContainerID, "error", err)
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), delTimeout)
	defer cancel()
	resp, err := p.notify(ctx, conf.AgentSocket, ev)
	switch {
	case err != nil:
		p.log.Warn("DEL: agent not told", "pod", ev.String(), "container", ev.ContainerID, "error", err)
	case resp.Error != "":
		p.log.Warn("DEL: agent reported an error", "pod", ev.String(), "container", ev.ContainerID, "error", resp.Error)
	}
	return nil
}

// verdict turns the agent's answer to ADD or CHECK, or its absence, into the
// plugin's outcome. The agent is authoritative when it answers. When it
// cannot be reached at all, the selection hint decides: a pod in an ambient
// namespace is refused (the runtime retries the sandbox later), any other pod
// goes ahead. A missing or unreadable hint refuses every pod, because then
// nothing says the pod is outside the mesh. An agent that was reached but did
// not answer in time also fails the command: it exists, so it is not safe to
// guess.
func (p *plugin) verdict(conf *netConf, ev cni.PodEvent, resp cni.Response, err error) error {
	sock := conf.AgentSocket
	if err == nil {
		if resp.Error == "" {
			return nil
		}
		return types.NewError(types.ErrInternal,
			fmt.Sprintf("redirector agent refused %s for pod %s: %s", ev.Command, ev, resp.Error), resp.Reason)
	}
	if !errors.Is(err, cni.ErrAgentUnreachable) {
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("redirector agent at %s did not answer %s for pod %s: %v", sock, ev.Command, ev, err), "")
	}
	refusal := "refusing to start it unmeshed"
	if ev.Command == cni.CommandCheck {
		refusal = "cannot confirm that it is"
	}
	hint, herr := cni.ReadSelectionHint(conf.SelectionHint)
	if herr != nil {
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("redirector agent unreachable at %s and no usable selection hint (%v): pod %s may belong in the ambient mesh; %s",
				sock, herr, ev, refusal), err.Error())
	}
	if hint.WouldEnroll(ev.PodNamespace) {
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("redirector agent unreachable at %s: pod %s would be enrolled in the ambient mesh; %s", sock, ev, refusal), err.Error())
	}
	p.log.Warn("redirector agent unreachable; namespace not ambient per selection hint, going ahead",
		"command", ev.Command, "pod", ev.String(), "socket", sock, "hint", conf.SelectionHint)
	return nil
}

// parseConf reads the plugin's configuration and the previous result, in the
// configuration's CNI version.
func parseConf(data []byte) (*netConf, error) {
	conf := &netConf{}
	if err := json.Unmarshal(data, conf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("parse redirector-cni configuration: %v", err), "")
	}
	var raw struct {
		PrevResult json.RawMessage `json:"prevResult"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("parse redirector-cni configuration: %v", err), "")
	}
	conf.rawPrevResult = raw.PrevResult
	if err := version.ParsePrevResult(&conf.PluginConf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("parse redirector-cni prevResult: %v", err), "")
	}
	if conf.AgentSocket == "" {
		conf.AgentSocket = cni.DefaultSocketPath
	}
	if conf.SelectionHint == "" {
		conf.SelectionHint = cni.DefaultHintPath
	}
	return conf, nil
}

// Keys the kubelet (through the runtime) puts in CNI_ARGS.
const (
	argPodName      = "K8S_POD_NAME"
	argPodNamespace = "K8S_POD_NAMESPACE"
	argPodUID       = "K8S_POD_UID"
)

// podEvent builds the event for the agent. ok is false for sandboxes that are
// not Kubernetes pods (no pod name or namespace in CNI_ARGS): the mesh has no
// say over them, so the plugin lets them through without asking.
func podEvent(cmd cni.Command, args *skel.CmdArgs, prev types.Result) (ev cni.PodEvent, ok bool, err error) {
	kv := parseCNIArgs(args.Args)
	ev = cni.PodEvent{
		Command:      cmd,
		PodName:      kv[argPodName],
		PodNamespace: kv[argPodNamespace],
		PodUID:       kv[argPodUID],
		ContainerID:  args.ContainerID,
		NetNS:        args.Netns,
		IfName:       args.IfName,
	}
	if ev.PodName == "" || ev.PodNamespace == "" {
		return ev, false, nil
	}
	if prev != nil {
		if ev.IPs, err = podIPs(prev, args.IfName); err != nil {
			return ev, false, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("read pod %s addresses from prevResult: %v", ev, err), "")
		}
	}
	return ev, true, nil
}

// parseCNIArgs reads CNI_ARGS ("K1=V1;K2=V2"). It is lenient on purpose:
// runtimes add keys of their own, and types.LoadArgs rejects unknown keys
// unless IgnoreUnknown is set.
func parseCNIArgs(s string) map[string]string {
	out := map[string]string{}
	for pair := range strings.SplitSeq(s, ";") {
		k, v, ok := strings.Cut(pair, "=")
		if ok && k != "" {
			out[k] = v
		}
	}
	return out
}

// podIPs returns the addresses the previous plugins gave the pod: those on
// its interface ifName (CNI_IFNAME) inside the sandbox, or with no interface
// named. Addresses on host-side interfaces (a bridge gateway, a ptp host
// end) are not the pod's, and those of another interface in the sandbox (a
// second network) are not on the interface the agent enrolls.
func podIPs(prev types.Result, ifName string) ([]netip.Prefix, error) {
	res, err := types100.NewResultFromResult(prev)
	if err != nil {
		return nil, err
	}
	var out []netip.Prefix
	for n, ipc := range res.IPs {
		if i := ipc.Interface; i != nil && *i >= 0 && *i < len(res.Interfaces) {
			if iface := res.Interfaces[*i]; iface.Sandbox == "" || (ifName != "" && iface.Name != ifName) {
				continue
			}
		}
		addr, ok := netip.AddrFromSlice(ipc.Address.IP)
		if !ok {
			return nil, fmt.Errorf("ips[%d]: bad address %v", n, ipc.Address.IP)
		}
		ones, bits := ipc.Address.Mask.Size()
		if bits == 0 {
			ones, bits = addr.BitLen(), addr.BitLen() // no mask given: a host address
		}
		if addr.Is4In6() && bits == 128 {
			// ::ffff:a.b.c.d/120 is a.b.c.d/24.
			ones -= 96
		}
		p := netip.PrefixFrom(addr.Unmap(), ones)
		if !p.IsValid() {
			// An invalid prefix is sent as "invalid Prefix", which the
			// agent cannot decode: every pod's ADD failed, in the mesh or
			// not, naming neither the entry nor the address.
			return nil, fmt.Errorf("ips[%d]: address %s with a %d-bit mask of %d bits is not a prefix", n, ipc.Address.IP, ones, bits)
		}
		out = append(out, p)
	}
	return out, nil
}
