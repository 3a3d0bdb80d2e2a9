package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/cni/cnitest"
)

const podNetNS = "/var/run/netns/cni-test-pod"

// prevResults are what a bridge + host-local chain reports, in each version
// the plugin supports. Index 0 is the bridge (host side, with an address of
// its own to show that host addresses are not the pod's), 2 is the pod's eth0.
var prevResults = map[string]string{
	"0.3.1": `{"cniVersion":"0.3.1",
		"interfaces":[{"name":"cni0","mac":"aa:bb:cc:00:00:01"},{"name":"veth1","mac":"aa:bb:cc:00:00:02"},{"name":"eth0","mac":"aa:bb:cc:00:00:03","sandbox":"` + podNetNS + `"}],
		"ips":[{"version":"4","interface":0,"address":"10.244.1.1/24"},{"version":"4","interface":2,"address":"10.244.1.5/24","gateway":"10.244.1.1"}],
		"routes":[{"dst":"0.0.0.0/0","gw":"10.244.1.1"}],
		"dns":{"nameservers":["10.96.0.10"]}}`,
	"0.4.0": `{"cniVersion":"0.4.0",
		"interfaces":[{"name":"cni0","mac":"aa:bb:cc:00:00:01"},{"name":"veth1","mac":"aa:bb:cc:00:00:02"},{"name":"eth0","mac":"aa:bb:cc:00:00:03","sandbox":"` + podNetNS + `"}],
		"ips":[{"version":"4","interface":0,"address":"10.244.1.1/24"},{"version":"4","interface":2,"address":"10.244.1.5/24","gateway":"10.244.1.1"},{"version":"6","interface":2,"address":"fd00:244:1::5/64"}],
		"routes":[{"dst":"0.0.0.0/0","gw":"10.244.1.1"}],
		"dns":{}}`,
	"1.0.0": `{"cniVersion":"1.0.0",
		"interfaces":[{"name":"cni0","mac":"aa:bb:cc:00:00:01"},{"name":"veth1","mac":"aa:bb:cc:00:00:02"},{"name":"eth0","mac":"aa:bb:cc:00:00:03","sandbox":"` + podNetNS + `"}],
		"ips":[{"interface":0,"address":"10.244.1.1/24"},{"interface":2,"address":"10.244.1.5/24","gateway":"10.244.1.1"},{"interface":2,"address":"fd00:244:1::5/64"}],
		"routes":[{"dst":"0.0.0.0/0","gw":"10.244.1.1"}],
		"dns":{}}`,
	"1.1.0": `{"cniVersion":"1.1.0",
		"interfaces":[{"name":"cni0","mac":"aa:bb:cc:00:00:01"},{"name":"veth1","mac":"aa:bb:cc:00:00:02","mtu":1450},{"name":"eth0","mac":"aa:bb:cc:00:00:03","mtu":1450,"sandbox":"` + podNetNS + `"}],
		"ips":[{"interface":0,"address":"10.244.1.1/24"},{"interface":2,"address":"10.244.1.5/24","gateway":"10.244.1.1"}],
		"routes":[{"dst":"0.0.0.0/0","gw":"10.244.1.1","mtu":1400}],
		"dns":{}}`,
}

// env is one plugin run's surroundings: where the agent would be, the hint
// file, and the plugin with captured output and logs.
type env struct {
	sock, hint string
	out, logs  bytes.Buffer
	p          *plugin
}

func newEnv(t *testing.T) *env {
	e := &env{sock: cnitest.SocketPath(t)}
	e.hint = filepath.Join(filepath.Dir(filepath.Dir(e.sock)), "ambient-namespaces.json")
	e.p = &plugin{stdout: &e.out, log: slog.New(slog.NewTextHandler(&e.logs, nil)), notify: cni.Notify}
	return e
}

// args builds the runtime's side of one call; prev "" leaves prevResult out.
func (e *env) args(t *testing.T, version, prev, cniArgs string) *skel.CmdArgs {
	t.Helper()
	conf := map[string]any{"cniVersion": version, "name": "podnet", "type": "redirector-cni",
		"agentSocket": e.sock, "selectionHint": e.hint}
	if prev != "" {
		conf["prevResult"] = json.RawMessage(prev)
	}
	data, err := json.Marshal(conf)
	if err != nil {
		t.Fatal(err)
	}
	return &skel.CmdArgs{ContainerID: "c0ffee", Netns: podNetNS, IfName: "eth0", Args: cniArgs, StdinData: data}
}

const k8sArgs = "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-1;K8S_POD_INFRA_CONTAINER_ID=c0ffee;K8S_POD_UID=8d0f7f2c-0001"

func TestAddPassesPrevResultThroughUnchanged(t *testing.T) {
	for version, prev := range prevResults {
		t.Run(version, func(t *testing.T) {
			e := newEnv(t)
			agent := &cnitest.Agent{}
			cnitest.Serve(t, e.sock, agent)
			if err := e.p.add(e.args(t, version, prev, k8sArgs)); err != nil {
				t.Fatalf("ADD: %v", err)
			}
			assertSameJSON(t, e.out.Bytes(), prev)

			events := agent.Events()
			if len(events) != 1 {
				t.Fatalf("agent got %d events, want 1", len(events))
			}
			want := cni.PodEvent{Command: cni.CommandAdd, PodName: "web-1", PodNamespace: "shop", PodUID: "8d0f7f2c-0001",
				ContainerID: "c0ffee", NetNS: podNetNS, IfName: "eth0", IPs: []netip.Prefix{netip.MustParsePrefix("10.244.1.5/24")}}
			if strings.Contains(prev, "fd00:244:1::5") {
				want.IPs = append(want.IPs, netip.MustParsePrefix("fd00:244:1::5/64"))
			}
			if !reflect.DeepEqual(events[0], want) {
				t.Errorf("agent got\n%+v\nwant\n%+v", events[0], want)
			}
		})
	}
}

func assertSameJSON(t *testing.T, got []byte, want string) {
	t.Helper()
	var g, w any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("output is not JSON: %v: %s", err, got)
	}
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(g, w) {
		t.Errorf("output differs from prevResult\n got: %s\nwant: %s", got, want)
	}
}

func TestAddWithoutPrevResultFails(t *testing.T) {
	e := newEnv(t)
	agent := &cnitest.Agent{}
	cnitest.Serve(t, e.sock, agent)
	err := e.p.add(e.args(t, "1.0.0", "", k8sArgs))
	if err == nil || !strings.Contains(err.Error(), "chained after") {
		t.Fatalf("ADD without prevResult: err = %v, want a chaining error", err)
	}
	if len(agent.Events()) != 0 || e.out.Len() != 0 {
		t.Errorf("agent told or result printed for a misconfigured chain")
	}
}

func TestAddSkipsNonKubernetesSandboxes(t *testing.T) {
	e := newEnv(t) // no agent, no hint: would refuse any pod
	for _, a := range []string{"", "IgnoreUnknown=1", "K8S_POD_NAME=web-1", "K8S_POD_NAMESPACE=shop"} {
		e.out.Reset()
		if err := e.p.add(e.args(t, "1.0.0", prevResults["1.0.0"], a)); err != nil {
			t.Errorf("ADD with CNI_ARGS %q: %v", a, err)
		}
		assertSameJSON(t, e.out.Bytes(), prevResults["1.0.0"])
	}
}

// TestAddDecision covers who decides: the agent when it answers, the
// selection hint only when it cannot be reached.
func TestAddDecision(t *testing.T) {
	refused := func(sock string) string {
		return fmt.Sprintf("redirector agent unreachable at %s: pod shop/web-1 would be enrolled in the ambient mesh; refusing to start it unmeshed", sock)
	}
	tests := []struct {
		name string
		// answer nil: no agent; else the agent answers with it.
		answer    func(cni.PodEvent) (cni.Response, error)
		stale     bool     // leave a dead agent's socket file
		hint      []string // ambient namespaces; nil: no hint file
		excluded  []string
		wantErr   func(sock string) string // "" : success
		wantCode  uint
		wantEvent bool
	}{
		{name: "agent enrolls", wantEvent: true,
			answer: func(cni.PodEvent) (cni.Response, error) { return cni.Response{Enrolled: true, Reason: "ambient"}, nil }},
		{name: "agent does not select", wantEvent: true, hint: []string{"shop"},
			answer: func(cni.PodEvent) (cni.Response, error) {
				return cni.Response{Reason: "pod label istio.io/dataplane-mode=none"}, nil
			}},
		{name: "agent fails to enroll", wantEvent: true, wantCode: types.ErrInternal,
			answer: func(cni.PodEvent) (cni.Response, error) {
				return cni.Response{}, errors.New("attach tcx: no such device")
			},
			wantErr: func(string) string {
				return "redirector agent refused ADD for pod shop/web-1: attach tcx: no such device"
			}},
		{name: "agent down, ambient namespace", hint: []string{"bank", "shop"}, wantErr: refused, wantCode: types.ErrTryAgainLater},
		{name: "agent dead, ambient namespace", stale: true, hint: []string{"shop"}, wantErr: refused, wantCode: types.ErrTryAgainLater},
		{name: "agent down, other namespace", hint: []string{"bank"}},
		{name: "agent down, no ambient namespace", hint: []string{}},
		{name: "agent down, ambient but excluded", hint: []string{"shop"}, excluded: []string{"shop"}},
		{name: "agent down, no hint", wantCode: types.ErrTryAgainLater, wantErr: func(sock string) string {
			return "redirector agent unreachable at " + sock + " and no usable selection hint"
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			agent := &cnitest.Agent{Answer: tt.answer}
			if tt.answer != nil {
				cnitest.Serve(t, e.sock, agent)
			}
			if tt.stale {
				// A killed agent leaves its socket file with nobody listening.
				if err := os.MkdirAll(filepath.Dir(e.sock), 0o700); err != nil {
					t.Fatal(err)
				}
				l, err := net.Listen("unix", e.sock)
				if err != nil {
					t.Fatal(err)
				}
				l.(*net.UnixListener).SetUnlinkOnClose(false)
				l.Close()
			}
			if tt.hint != nil {
				if err := cni.WriteSelectionHint(e.hint, tt.hint, tt.excluded); err != nil {
					t.Fatal(err)
				}
			}
			err := e.p.add(e.args(t, "1.0.0", prevResults["1.0.0"], k8sArgs))
			if tt.wantErr == nil {
				if err != nil {
					t.Fatalf("ADD: %v", err)
				}
				assertSameJSON(t, e.out.Bytes(), prevResults["1.0.0"])
			} else {
				var cniErr *types.Error
				if !errors.As(err, &cniErr) {
					t.Fatalf("ADD: err = %v, want a CNI error", err)
				}
				if want := tt.wantErr(e.sock); !strings.HasPrefix(cniErr.Msg, want) {
					t.Errorf("message = %q\nwant prefix %q", cniErr.Msg, want)
				}
				if cniErr.Code != tt.wantCode {
					t.Errorf("code = %d, want %d", cniErr.Code, tt.wantCode)
				}
				if e.out.Len() != 0 {
					t.Errorf("failed ADD printed a result: %s", e.out.Bytes())
				}
			}
			if got := len(agent.Events()) == 1; got != tt.wantEvent {
				t.Errorf("agent told: %v, want %v", got, tt.wantEvent)
			}
		})
	}
}

func TestVerdictAgentTooSlow(t *testing.T) {
	e := newEnv(t)
	if err := cni.WriteSelectionHint(e.hint, nil, nil); err != nil {
		t.Fatal(err)
	}
	conf := &netConf{AgentSocket: e.sock, SelectionHint: e.hint}
	ev := cni.PodEvent{Command: cni.CommandAdd, PodName: "web-1", PodNamespace: "default"}
	// Reached but silent: the hint must not be consulted, even for a pod it
	// would let through.
	err := e.p.verdict(conf, ev, cni.Response{}, context.DeadlineExceeded)
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || cniErr.Code != types.ErrTryAgainLater || !strings.Contains(cniErr.Msg, "did not answer ADD for pod default/web-1") {
		t.Errorf("err = %v, want try-again-later naming the pod", err)
	}
}

func TestCheck(t *testing.T) {
	e := newEnv(t)
	agent := &cnitest.Agent{}
	stop := cnitest.Serve(t, e.sock, agent)
	args := e.args(t, "1.0.0", prevResults["1.0.0"], k8sArgs)
	if err := e.p.check(args); err != nil {
		t.Errorf("CHECK of an enrolled pod: %v", err)
	}
	agent.SetAnswer(func(cni.PodEvent) (cni.Response, error) {
		return cni.Response{Reason: "namespace shop is ambient", Error: "pod should be enrolled but is not"}, nil
	})
	if err := e.p.check(args); err == nil || !strings.Contains(err.Error(), "pod should be enrolled but is not") {
		t.Errorf("CHECK of a pod missing from the mesh: err = %v", err)
	}
	if evs := agent.Events(); len(evs) != 2 || evs[0].Command != cni.CommandCheck {
		t.Errorf("agent events = %+v, want two CHECKs", evs)
	}
	if e.out.Len() != 0 {
		t.Errorf("CHECK printed %s", e.out.Bytes())
	}

	stop()
	if err := cni.WriteSelectionHint(e.hint, []string{"shop"}, nil); err != nil {
		t.Fatal(err)
	}
	if err := e.p.check(args); err == nil || !strings.Contains(err.Error(), "cannot confirm") {
		t.Errorf("CHECK with the agent down, ambient namespace: err = %v", err)
	}
	if err := e.p.check(e.args(t, "1.0.0", prevResults["1.0.0"], "")); err != nil {
		t.Errorf("CHECK of a non-Kubernetes sandbox: %v", err)
	}
}

func TestDelNeverFails(t *testing.T) {
	e := newEnv(t)
	del := e.args(t, "1.0.0", "", k8sArgs)
	del.Netns = "" // the runtime may have destroyed it already

	if err := e.p.del(del); err != nil {
		t.Errorf("DEL with the agent down: %v", err)
	}
	if !strings.Contains(e.logs.String(), "agent not told") {
		t.Errorf("DEL with the agent down logged nothing: %q", e.logs.String())
	}

	agent := &cnitest.Agent{}
	cnitest.Serve(t, e.sock, agent)
	if err := e.p.del(del); err != nil {
		t.Errorf("DEL: %v", err)
	}
	want := cni.PodEvent{Command: cni.CommandDel, PodName: "web-1", PodNamespace: "shop", PodUID: "8d0f7f2c-0001", ContainerID: "c0ffee", IfName: "eth0"}
	if evs := agent.Events(); len(evs) != 1 || !reflect.DeepEqual(evs[0], want) {
		t.Errorf("agent events = %+v, want %+v", evs, want)
	}

	agent.SetAnswer(func(cni.PodEvent) (cni.Response, error) { return cni.Response{}, errors.New("detach: busy") })
	if err := e.p.del(del); err != nil {
		t.Errorf("DEL the agent failed: %v", err)
	}
	del.StdinData = []byte("{not json")
	if err := e.p.del(del); err != nil {
		t.Errorf("DEL with a broken configuration: %v", err)
	}
}

func TestParseCNIArgs(t *testing.T) {
	got := parseCNIArgs("IgnoreUnknown=1;K8S_POD_NAME=web-1;;bogus;K8S_POD_NAMESPACE=shop;EMPTY=")
	want := map[string]string{"IgnoreUnknown": "1", "K8S_POD_NAME": "web-1", "K8S_POD_NAMESPACE": "shop", "EMPTY": ""}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("parseCNIArgs = %v, want %v", got, want)
	}
}

// TestPodIPsOnlyOfItsInterface: with several interfaces in the sandbox (a
// chain that adds a second network), only the addresses of the interface
// the runtime named (CNI_IFNAME) are the pod's: the agent enrolls them on
// that interface, where another interface's address is not (seen failing:
// net1's address was reported, and every ADD of the pod failed). Addresses
// without an interface, and of the named one, are kept.
func TestPodIPsOnlyOfItsInterface(t *testing.T) {
	prev := `{"cniVersion":"1.0.0",
		"interfaces":[{"name":"cni0"},{"name":"eth0","sandbox":"` + podNetNS + `"},{"name":"net1","sandbox":"` + podNetNS + `"}],
		"ips":[{"interface":0,"address":"10.244.1.1/24"},{"interface":1,"address":"10.244.1.5/24"},{"interface":2,"address":"192.168.50.5/24"},{"address":"fd00::5/64"}]}`
	e := newEnv(t)
	agent := &cnitest.Agent{}
	cnitest.Serve(t, e.sock, agent)
	if err := e.p.add(e.args(t, "1.0.0", prev, k8sArgs)); err != nil {
		t.Fatal(err)
	}
	evs := agent.Events()
	if len(evs) != 1 {
		t.Fatalf("agent got %d events", len(evs))
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.244.1.5/24"), netip.MustParsePrefix("fd00::5/64")}
	if !reflect.DeepEqual(evs[0].IPs, want) {
		t.Errorf("addresses sent: %v, want %v (eth0's and the unattributed one)", evs[0].IPs, want)
	}
}

// TestPodIPsMappedAddress: an IPv4 address written IPv4-mapped, with a mask
// of 128 bits, reaches the agent as the IPv4 prefix it is, and one with no
// IPv4 prefix to it fails the ADD naming the entry (seen failing: the
// plugin unmapped the address but kept the mask's length, sent the agent
// an invalid prefix, and the agent refused to decode the event: the ADD
// failed for any pod, in the mesh or not, naming neither entry nor address).
func TestPodIPsMappedAddress(t *testing.T) {
	prev := func(addr string) string {
		return `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"` + podNetNS + `"}],"ips":[{"interface":0,"address":"` + addr + `"}]}`
	}
	e := newEnv(t)
	agent := &cnitest.Agent{}
	cnitest.Serve(t, e.sock, agent)
	if err := e.p.add(e.args(t, "1.0.0", prev("::ffff:10.244.1.5/120"), k8sArgs)); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	evs := agent.Events()
	if want := []netip.Prefix{netip.MustParsePrefix("10.244.1.5/24")}; len(evs) != 1 || !reflect.DeepEqual(evs[0].IPs, want) {
		t.Errorf("agent events %+v, want one with %v", evs, want)
	}

	agent.Reset()
	e.out.Reset()
	err := e.p.add(e.args(t, "1.0.0", prev("::ffff:10.244.1.5/64"), k8sArgs))
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || cniErr.Code != types.ErrDecodingFailure || !strings.Contains(cniErr.Msg, "ips[0]") {
		t.Errorf("ADD with a mapped address under a /64: err = %v, want a decoding failure naming ips[0]", err)
	}
	if len(agent.Events()) != 0 || e.out.Len() != 0 {
		t.Errorf("agent told %+v or result printed %q", agent.Events(), e.out.String())
	}
}
