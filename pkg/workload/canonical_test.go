package workload

import "testing"

func TestCanonicalService(t *testing.T) {
	for _, tc := range []struct {
		labels         map[string]string
		name, revision string
	}{
		{map[string]string{"app": "reviews", "version": "v2"}, "reviews", "v2"},
		{map[string]string{"app.kubernetes.io/name": "kname", "app": "reviews", "app.kubernetes.io/version": "1.2", "version": "v2"}, "kname", "1.2"},
		{map[string]string{LabelCanonicalName: "canon", LabelCanonicalRevision: "r1", "app": "reviews", "version": "v2"}, "canon", "r1"},
		{nil, "reviews-v2", "latest"},
	} {
		name, rev := CanonicalService(tc.labels, "reviews-v2")
		if name != tc.name || rev != tc.revision {
			t.Errorf("%v: got %s %s, want %s %s", tc.labels, name, rev, tc.name, tc.revision)
		}
	}
}
