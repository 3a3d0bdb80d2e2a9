package tunnel

import (
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestOutboundBeforeMeshSyncNeverPlaintext: with SOURCE=xds the agent
// serves this node's pods from the node's pod watch before istiod has
// answered (a CNI ADD never waits on istiod), and after a restart or in an
// upgrade the pods it takes over were meshed already. Until istiod's first
// answer the directory holds only this node's pods: every other address
// read as no workload's, and the pods' connections to meshed pods of other
// nodes and to service VIPs left in plaintext (for as long as istiod did
// not answer). Such a connection now waits for the control plane's first
// answer, and is refused if it does not come in time; once it has come, an
// address it does not know is outside the mesh and reached directly.
func TestOutboundBeforeMeshSyncNeverPlaintext(t *testing.T) {
	defer func(d time.Duration) { meshWait = d }(meshWait)
	meshWait = 300 * time.Millisecond
	tun := tunnelWithPool(t)
	witness := newPlainWitness(t, "127.0.0.2:0")
	dst := "127.0.0.2:" + strconv.Itoa(int(witness.port()))
	dir, errs := workload.NewDirectory([]*workload.Workload{podObj("mesh", "client", "client", "10.1.0.1", nil)}, nil)
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	p := outboundClient(t, tun)
	connect := func() (reached bool) {
		t.Helper()
		return witness.reachedFrom(t, p, dst, 10*time.Second)
	}

	tun.Update(&State{Dir: dir, Compiled: &policy.CompiledSet{}})
	if connect() {
		t.Errorf("to %s before istiod's first answer: the request reached it in plaintext", dst)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.failClosed.WithLabelValues("mesh_not_synced")); got != 1 {
		t.Errorf(`redirector_fail_closed_total{reason="mesh_not_synced"} = %v, want 1`, got)
	}

	// The answer comes while a connection waits: it goes on, delayed.
	meshWait = 10 * time.Second
	time.AfterFunc(200*time.Millisecond, func() { tun.Update(&State{Dir: dir, Compiled: &policy.CompiledSet{Synced: true}}) })
	if !connect() {
		t.Errorf("to %s, an address istiod does not know, once it answered: not reached", dst)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.failClosed.WithLabelValues("mesh_not_synced")); got != 1 {
		t.Errorf(`redirector_fail_closed_total{reason="mesh_not_synced"} = %v, want still 1`, got)
	}
	if !connect() {
		t.Errorf("to %s after istiod answered: not reached", dst)
	}
}
