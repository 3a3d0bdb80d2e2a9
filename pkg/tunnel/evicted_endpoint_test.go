package tunnel

import (
	"fmt"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// A Connect of a pod being stopped fails once the pool evicted the pod's
// connections (its CONNECT reserved on one, or waiting for one being
// dialled), with hbone.ErrEvicted rather than going round and dialling
// anew from the evicted pod (since 7 December). That failure is the
// client's: taken for the endpoint's, it marked a healthy endpoint failed
// for every pod of the node for 10 s, so a tenant deleting its pods steered
// the node's service connections away from the endpoints they were
// connecting to. So is a pool closed under the Connect.
func TestEvictedSourceIsNotTheEndpointsFailure(t *testing.T) {
	for _, err := range []error{hbone.ErrEvicted, hbone.ErrPoolClosed} {
		err = fmt.Errorf("HBONE to 10.0.0.1:80 via 10.0.0.1:15008: hbone connect 10.0.0.1:80 via 10.0.0.1:15008: %w", err)
		if endpointFailed(err) {
			t.Errorf("%v: endpointFailed = true, want false", err)
		}
	}
}
