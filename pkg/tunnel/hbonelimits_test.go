package tunnel

import (
	"testing"

	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// TestHBONEHandlerLimitFollowsPerSource: the HBONE servers' bound on the
// streams one client address holds a handler for stays above the tunnels
// the agent relays for that address, so an operator raising
// MAX_CONNECTIONS_PER_SOURCE (an ingress's pools) never has those tunnels
// refused by the HBONE layer first.
func TestHBONEHandlerLimitFollowsPerSource(t *testing.T) {
	for _, perSource := range []int{1, DefaultLimits().PerSource, 10000} {
		got := hboneLimitsFor(Limits{PerSource: perSource}).MaxHandlersPerSource
		if got < 2*perSource || got < hbone.DefaultMaxHandlersPerSource {
			t.Errorf("PerSource %d: MaxHandlersPerSource %d, want at least %d and the default %d", perSource, got, 2*perSource, hbone.DefaultMaxHandlersPerSource)
		}
	}
}
