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
	"strings"
	"unicode"

	"k8s.io/apimachinery/pkg/util/validation"
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
	return e.validateFields()
}

// Bounds of the fields that are not Kubernetes names. A pod UID is a UUID
// (or a static pod's hash); a container id is a runtime's hash.
const (
	maxUIDLen         = 128
	maxContainerIDLen = 256
	maxNetNSLen       = 4096 // PATH_MAX
)

// validateFields refuses values no runtime sends: the agent keys its
// records by namespace/name, keeps them for the sandbox's life and writes
// them into logs and errors, so a name with a slash or a megabyte of it
// must not get that far. Each error names the CNI variable it came from.
func (e PodEvent) validateFields() error {
	field := func(name, value string, errs []string) error {
		if len(errs) == 0 {
			return nil
		}
		return fmt.Errorf("%s event: %s %q: %s", e.Command, name, truncateStr(value, 80), strings.Join(errs, "; "))
	}
	if err := field("K8S_POD_NAMESPACE", e.PodNamespace, validation.IsDNS1123Label(e.PodNamespace)); err != nil {
		return err
	}
	if err := field("K8S_POD_NAME", e.PodName, validation.IsDNS1123Subdomain(e.PodName)); err != nil {
		return err
	}
	if e.PodUID != "" && (len(e.PodUID) > maxUIDLen || !isToken(e.PodUID, "-")) {
		return field("K8S_POD_UID", e.PodUID, []string{fmt.Sprintf("must be at most %d letters, digits and '-'", maxUIDLen)})
	}
	if len(e.ContainerID) > maxContainerIDLen || !isToken(e.ContainerID, "_.-") {
		return field("CNI_CONTAINERID", e.ContainerID, []string{fmt.Sprintf("must be at most %d letters, digits, '_', '.' and '-'", maxContainerIDLen)})
	}
	if e.Command == CommandDel {
		return nil // the namespace and interface may be gone; DEL needs neither
	}
	if len(e.NetNS) > maxNetNSLen || strings.ContainsRune(e.NetNS, 0) {
		return field("CNI_NETNS", e.NetNS, []string{fmt.Sprintf("must be a path of at most %d bytes without NUL", maxNetNSLen)})
	}
	if e.IfName != "" && (len(e.IfName) > 15 || e.IfName == "." || e.IfName == ".." || strings.ContainsFunc(e.IfName, func(r rune) bool {
		return r == '/' || r == ':' || r == '%' || unicode.IsSpace(r) || !unicode.IsPrint(r)
	})) {
		return field("CNI_IFNAME", e.IfName, []string{"must be an interface name: at most 15 bytes, not . or .., no '/', ':', '%' or space"})
	}
	return nil
}

// isToken says whether s is letters and digits (ASCII) and the extra bytes.
func isToken(s, extra string) bool {
	for _, r := range s {
		if !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || strings.ContainsRune(extra, r)) {
			return false
		}
	}
	return true
}

func truncateStr(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
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
// fall back to the selection hint; any other failure (a full accept queue
// included) means the agent may exist and was not able to answer in time.
var ErrAgentUnreachable = errors.New("redirector agent unreachable")
