package nodeagent

import (
	"testing"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/source"
)

// TestCompleteSnapshot: an agent takes the node over only with state it
// can serve with. The xDS source's snapshots before istiod's first answer
// (policies not synced) are not that: taken with one, the old agent yielded
// and every connection of the node's pods was refused until istiod
// answered. The file and Kubernetes sources set no compiled policies.
func TestCompleteSnapshot(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    source.Snapshot
		want bool
	}{
		{"file or Kubernetes source", source.Snapshot{}, true},
		{"xDS before istiod answered", source.Snapshot{Compiled: &policy.CompiledSet{}}, false},
		{"xDS after istiod answered", source.Snapshot{Compiled: &policy.CompiledSet{Synced: true}}, true},
	} {
		if got := complete(tc.s); got != tc.want {
			t.Errorf("%s: complete = %v, want %v", tc.name, got, tc.want)
		}
	}
}
