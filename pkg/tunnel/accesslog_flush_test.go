package tunnel

import (
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/syncbuf"
)

// A line is written out without Close, also after the writer sat idle (its
// flush timer runs only while lines wait).
func TestAccessLogWriterFlushesAfterIdle(t *testing.T) {
	var out syncbuf.Buffer
	w := NewAccessLogWriter(&out)
	defer w.Close()
	for i, line := range []string{"first\n", "second\n"} {
		if _, err := w.Write([]byte(line)); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for strings.Count(out.String(), "\n") != i+1 {
			if time.Now().After(deadline) {
				t.Fatalf("line %q not flushed; written so far: %q", line, out.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(3 * accessLogFlushEvery) // idle: no timer running
	}
}
