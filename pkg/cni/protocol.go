// Package cni is the protocol between the redirector-cni plugin and the agent.
//
// The container runtime runs the plugin, chained last, for every pod sandbox
// it creates or deletes. The plugin cannot decide enrollment itself (CNI
// carries no labels), so it forwards the event to the agent over a unix
// socket and waits: the agent's answer is authoritative, and for ADD it
// answers only once the pod is enrolled (programs attached, listeners open),
// so a selected pod never starts unmeshed. When the agent cannot be reached,
// the plugin falls back to the selection hint the agent leaves next to the
// socket (see SelectionHint).
//
// The wire format is JSON over HTTP/1.1 on the unix socket: one POST of a
// PodEvent to EventPath, one Response back.
package cni

import (
	"errors"
	"fmt"
	"net/netip"
)

// Default locations, shared by the agent and the plugin's configuration.
const (
	// DefaultSocketPath is where the agent listens for plugin events.
	DefaultSocketPath = "/var/run/redirector/cni.sock"
	// DefaultHintPath is where the agent writes its selection hint.
	DefaultHintPath = "/var/run/redirector/ambient-namespaces.json"
)

// EventPath is the HTTP path events are posted to. It is versioned so that a
// plugin left on a node by an older or newer agent fails loudly.
const EventPath = "/v1/pod-event"

// Command is the CNI operation that produced an event.
type Command string

// The CNI operations forwarded to the agent. VERSION, GC and STATUS never are.
const (
	CommandAdd   Command = "ADD"
	CommandDel   Command = "DEL"
	CommandCheck Command = "CHECK"
)

// PodEvent is what the plugin tells the agent about one pod sandbox.
type PodEvent struct {
	Command      Command `json:"command"`
	PodName      string  `json:"podName"`
	PodNamespace string  `json:"podNamespace"`
	// PodUID comes from K8S_POD_UID in CNI_ARGS; older runtimes omit it.
	PodUID      string `json:"podUID,omitempty"`
	ContainerID string `json:"containerID"`
	// NetNS is CNI_NETNS: the path of the pod's network namespace. It may be
	// empty on DEL, when the runtime has already destroyed the namespace.
	NetNS  string `json:"netns,omitempty"`
	IfName string `json:"ifName,omitempty"`
	// IPs are the pod's addresses with their subnet lengths, taken from the
	// previous plugins' result (for example 10.244.1.5/24).
	IPs []netip.Prefix `json:"ips,omitempty"`
}

// String names the pod as namespace/name for logs and messages.
func (e PodEvent) String() string { return e.PodNamespace + "/" + e.PodName }

// Validate reports what makes the event unusable, so that a broken plugin or
// runtime is named instead of silently enrolling nothing.
func (e PodEvent) Validate() error {
	switch e.Command {
	case CommandAdd, CommandCheck:
		if e.NetNS == "" {
			return fmt.Errorf("%s event for pod %s has no network namespace path", e.Command, e)
		}
	case CommandDel:
	default:
		return fmt.Errorf("unknown command %q", e.Command)
	}
	if e.PodName == "" || e.PodNamespace == "" {
		return fmt.Errorf("%s event lacks the pod name or namespace (%q)", e.Command, e.String())
	}
	if e.ContainerID == "" {
		return fmt.Errorf("%s event for pod %s has no container id", e.Command, e)
	}
	return nil
}

// Response is the agent's answer.
type Response struct {
	// Enrolled says whether the pod is enrolled in the mesh now (after ADD:
	// programs attached and listeners open).
	Enrolled bool `json:"enrolled"`
	// Reason is the selection rule that decided, for logs and messages.
	Reason string `json:"reason,omitempty"`
	// Error, when set, says the pod is not in the state it must be in: for
	// ADD, a selected pod could not be enrolled; for CHECK, a pod that should
	// be enrolled is not. The plugin fails the operation with this message.
	Error string `json:"error,omitempty"`
}

// ErrAgentUnreachable marks a Notify error that happened before the agent saw
// the event: no socket, or nobody listening on it. Only then may the plugin
// fall back to the selection hint; any later failure means the agent exists
// and was not able to answer in time.
var ErrAgentUnreachable = errors.New("redirector agent unreachable")
