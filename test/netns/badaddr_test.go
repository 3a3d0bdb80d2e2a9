package netnstest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestBadPodAddressKeepsNodeReady: pods whose address cannot be a pod's
// (unspecified, loopback, its IPv4-mapped form, multicast, link-local) are
// refused with the reason in the log and in /config_dump, are never
// enrolled, and leave the node ready with its good pod served. Before, one
// such pod was wanted but could never attach, and readiness waited for it
// forever.
func TestBadPodAddressKeepsNodeReady(t *testing.T) {
	tp := New(t, 1)
	good, server := tp.Nodes[0].AddPod("good"), tp.Nodes[0].AddPod("server")
	dir := t.TempDir()
	manifest, ca := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "ca")
	m := (&Manifest{}).Namespace("shop", "istio.io/dataplane-mode=ambient").Pod(good, "shop", "good")
	bad := map[string]string{
		"unspec":    "0.0.0.0",
		"loopback":  "127.0.0.1",
		"mapped":    "::ffff:127.0.0.1",
		"multicast": "224.0.0.1",
		"linklocal": "fe80::1",
	}
	for name, ip := range bad {
		m = m.Raw(`
apiVersion: v1
kind: Pod
metadata: {name: ` + name + `, namespace: shop, uid: uid-` + name + `}
spec: {nodeName: node1, containers: [{name: c, image: c}]}
status: {phase: Running, podIP: "` + ip + `"}`)
	}
	if err := os.WriteFile(manifest, []byte(m.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	initCA(t, ca)
	ag := StartAgent(t, tp.Nodes[0], AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca})
	waitEnrolled(t, ag.BPFRoot, 10*time.Second, "shop/good")
	for name := range bad {
		ag.WaitLog(t, "shop/"+name, 5*time.Second)
	}
	Eventually(t, 10*time.Second, func() error {
		out, err := Exec(context.Background(), ag.Node.Path(), "curl", "-sS", "-o", "/dev/stderr", "-w", "%{http_code}", "http://127.0.0.1:15021/healthz/ready")
		if err != nil {
			return err
		}
		if code, _ := strconv.Atoi(strings.TrimSpace(string(out[len(out)-3:]))); code != 200 {
			return fmt.Errorf("readiness %d: %s", code, out)
		}
		return nil
	})
	dump, err := CurlFrom(ag.Node.Path(), "http://127.0.0.1:15000/config_dump")
	if err != nil {
		t.Fatal(err)
	}
	for _, why := range []string{"is unspecified", "is loopback", "is multicast", "is link-local"} {
		if !strings.Contains(dump, why) {
			t.Errorf("/config_dump does not give the reason %q", why)
		}
	}
	// Nothing of them is enrolled; the good pod works.
	got, err := enrolledNames(ag.BPFRoot)
	if err != nil || len(got) != 1 {
		t.Errorf("enrolled: %v %v, want only shop/good", got, err)
	}
	HTTPApp(t, server, 8080, "server")
	if out, err := Curl(good, URL(server.IPv4, 8080)); err != nil || !strings.Contains(out, "server peer=") {
		t.Errorf("the good pod does not work next to the bad addresses: %q %v", out, err)
	}
}
