package admin

import (
	"fmt"
	"strings"
)

// Check is one readiness condition: ok, or the reason it is not.
type Check func() (ok bool, reason string)

// AllReady combines checks into an Options.Ready: ready when every check is,
// otherwise the reasons of all failing checks, so that one probe shows
// everything still missing rather than one thing at a time.
func AllReady(checks ...Check) func() (bool, string) {
	return func() (bool, string) {
		var reasons []string
		for _, c := range checks {
			if ok, reason := c(); !ok {
				reasons = append(reasons, reason)
			}
		}
		return len(reasons) == 0, strings.Join(reasons, "; ")
	}
}

// maxListed is how many problems one readiness reason names before it
// only counts the rest: enough to act on, short enough to read.
const maxListed = 3

// ProblemsCheck turns a list of problems into a Check: ready when the list
// is empty, otherwise the first few problems and how many more there are.
// The agent passes tunnel.Tunnel.ListenerProblems, so that a listener that
// stopped accepting (EMFILE, closed under a served pod) names its pod and
// port in the readiness body.
func ProblemsCheck(problems func() []string) Check {
	return func() (bool, string) {
		list := problems()
		if len(list) == 0 {
			return true, ""
		}
		shown := list
		if len(list) > maxListed {
			shown = append(list[:maxListed:maxListed], fmt.Sprintf("and %d more", len(list)-maxListed))
		}
		return false, strings.Join(shown, "; ")
	}
}
