package maps

import (
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/bpf"
)

// TestEveryReasonNamed: a reason added to enum verdict_reason without a name
// here would show up in metrics as reason_<n>; two reasons with one name would
// merge their series.
func TestEveryReasonNamed(t *testing.T) {
	seen := map[string]Reason{}
	for r := Reason(0); r < bpf.CaptureVerdictReasonREASON_MAX; r++ {
		n := ReasonName(r)
		if strings.HasPrefix(n, "reason_") {
			t.Errorf("reason %d has no name", r)
		}
		if o, dup := seen[n]; dup {
			t.Errorf("reasons %d and %d are both named %q", o, r, n)
		}
		seen[n] = r
	}
}
