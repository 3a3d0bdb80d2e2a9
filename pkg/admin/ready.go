package admin

import "strings"

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
