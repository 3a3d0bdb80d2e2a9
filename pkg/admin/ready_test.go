package admin

import (
	"strings"
	"testing"
)

func TestProblemsCheck(t *testing.T) {
	var list []string
	check := ProblemsCheck(func() []string { return list })
	if ok, reason := check(); !ok || reason != "" {
		t.Errorf("no problems: %v %q, want ready", ok, reason)
	}
	list = []string{"pod a/x port 15001: accept failing", "pod a/y port 15006: listener closed", "p3", "p4", "p5"}
	ok, reason := check()
	if ok || !strings.Contains(reason, "pod a/x port 15001") || !strings.Contains(reason, "and 2 more") || strings.Contains(reason, "p4") {
		t.Errorf("five problems: %v %q, want the first three and a count", ok, reason)
	}
	if len(list) != 5 || list[3] != "p4" {
		t.Errorf("the check changed its source's list: %q", list)
	}
	ok, reason = AllReady(func() (bool, string) { return true, "" }, check)()
	if ok || !strings.HasPrefix(reason, "pod a/x") {
		t.Errorf("AllReady with a failing ProblemsCheck: %v %q", ok, reason)
	}
}
