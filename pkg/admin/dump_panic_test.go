package admin

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestConfigDumpSurvivesPanickingSection: a section that panics (a bug in
// how it reads the agent's state, met in some state of it) fails that dump
// with an error naming the section, and the next dump is built. Before,
// net/http recovered the panic and closed the connection without a word,
// and the dump's build slot stayed held: every later config dump waited
// for it until its caller gave up, so istioctl and `redirector inspect`
// got nothing until the agent restarted.
func TestConfigDumpSurvivesPanickingSection(t *testing.T) {
	var calls atomic.Int64
	s := start(t, Options{Sections: map[string]func() any{
		"workloads": func() any {
			if calls.Add(1) == 1 {
				var m map[string]int
				m["x"] = 1 // a nil map: panics
			}
			return []string{"w"}
		},
	}})
	client := &http.Client{Timeout: 3 * time.Second}
	url := "http://" + s.AdminAddr() + "/config_dump"
	if resp, err := client.Get(url); err == nil {
		var b strings.Builder
		buf := make([]byte, 512)
		n, _ := resp.Body.Read(buf)
		b.Write(buf[:n])
		resp.Body.Close()
		if resp.StatusCode != http.StatusInternalServerError || !strings.Contains(b.String(), "section workloads: panic") {
			t.Errorf("dump with a panicking section: %d %q, want 500 naming the section and the panic", resp.StatusCode, b.String())
		}
	} else {
		t.Errorf("dump with a panicking section: %v, want 500 naming the section", err)
	}
	resp, err := client.Get(url)
	if err != nil {
		t.Fatalf("the next dump: %v (its build slot still held?)", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("the next dump: %d, want 200", resp.StatusCode)
	}
}
