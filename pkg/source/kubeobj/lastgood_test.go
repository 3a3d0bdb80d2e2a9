package kubeobj

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// objectList is an ObjectSource that hands out a fixed sequence of objects.
type objectList []Objects

func (l objectList) Run(_ context.Context, update func(Objects)) error {
	for _, o := range l {
		update(o)
	}
	return nil
}

// TestSourceKeepsPodWithMalformedAddress: through kubeobj.Source (any
// ObjectSource), an enrolled pod whose address stops parsing stays, at its
// last good address and enrolled, with the error naming the pod and field;
// a fix is taken as usual, and a new pod of the same name (another uid)
// that is malformed from the start is left out, not given the old one's
// state. Before, the pod was dropped from the snapshot and so unenrolled.
func TestSourceKeepsPodWithMalformedAddress(t *testing.T) {
	ns := []corev1.Namespace{ambientNamespace("shop")}
	good := pod("shop", "web", "node-a", "10.0.0.5")
	other := pod("shop", "db", "node-a", "10.0.0.7")
	var steps []Objects
	for _, bad := range []string{"10.0.0.300", "10.0.0.05", "fe80::1%eth0", "", "garbage"} {
		p := pod("shop", "web", "node-a", "10.0.0.5")
		p.Status.PodIPs = []corev1.PodIP{{IP: bad}}
		steps = append(steps, Objects{Namespaces: ns, Pods: []corev1.Pod{other, p}})
	}
	fixed := pod("shop", "web", "node-a", "10.0.0.6")
	recreated := pod("shop", "web", "node-a", "10.0.0.300")
	recreated.UID = types.UID("uid-web-2")
	steps = append([]Objects{{Namespaces: ns, Pods: []corev1.Pod{other, good}}}, steps...)
	steps = append(steps, Objects{Namespaces: ns, Pods: []corev1.Pod{other, fixed}}, Objects{Namespaces: ns, Pods: []corev1.Pod{other, recreated}})

	var snaps []source.Snapshot
	var logs errorLog
	src := NewSource(objectList(steps), selection.Config{}, slog.New(&logs))
	if err := src.Run(context.Background(), func(s source.Snapshot) { snaps = append(snaps, s) }); err != nil {
		t.Fatal(err)
	}
	if len(snaps) != len(steps) {
		t.Fatalf("%d snapshots for %d object sets", len(snaps), len(steps))
	}
	web := func(s source.Snapshot) *workload.Workload {
		for _, w := range s.Workloads {
			if w.Name == "web" {
				return w
			}
		}
		return nil
	}
	for i, s := range snaps[1:6] {
		w := web(s)
		if w == nil || !w.Enrolled || len(w.Addrs) != 1 || w.Addrs[0] != addr("10.0.0.5") || names(s.Workloads) != "shop/db shop/web" {
			t.Errorf("malformed address %d: web = %+v, workloads %s; want the last good version, enrolled at 10.0.0.5", i, w, names(s.Workloads))
		}
	}
	if w := web(snaps[6]); w == nil || w.Addrs[0] != addr("10.0.0.6") {
		t.Errorf("after the fix: web = %+v, want 10.0.0.6", w)
	}
	if w := web(snaps[7]); w != nil {
		t.Errorf("a new pod of the same name, malformed from the start: %+v, want left out", w)
	}
	if len(logs.msgs) != 6 {
		t.Fatalf("logged %d errors, want 6: %q", len(logs.msgs), logs.msgs)
	}
	for i, bad := range []string{"10.0.0.300", "10.0.0.05", "fe80::1%eth0", "", "garbage"} {
		want := `pod shop/web: status.podIPs[0].ip: bad IP "` + bad + `"`
		if got := logs.msgs[i]; !strings.Contains(got, want) || !strings.Contains(got, "last good version") {
			t.Errorf("error %d = %q, want the pod, the field, %q, and that its last good version is kept", i, got, want)
		}
	}
	if got := logs.msgs[5]; strings.Contains(got, "last good version") || !strings.Contains(got, "pod shop/web: status.podIPs[0].ip") {
		t.Errorf("error for the recreated pod = %q", got)
	}
}

// TestLastGoodCopies: a kept workload is a copy, so a caller completing
// the snapshot's workloads (the xDS source sets waypoints) never writes to
// one an earlier snapshot handed out.
func TestLastGoodCopies(t *testing.T) {
	var l LastGood
	first := source.Snapshot{Workloads: []*workload.Workload{{Namespace: "shop", Name: "web", UID: "u1", Enrolled: true}}}
	l.Keep(&first, nil)
	next := source.Snapshot{}
	errs := l.Keep(&next, []error{&selection.PodAddrError{Namespace: "shop", Name: "web", UID: "u1", Field: "status.podIP", Value: "x", Err: errors.New("bad")}})
	if len(next.Workloads) != 1 || next.Workloads[0] == first.Workloads[0] || !next.Workloads[0].Enrolled {
		t.Fatalf("kept %+v, want a copy of the first", next.Workloads)
	}
	if !errors.As(errs[0], new(KeptError)) {
		t.Errorf("error %v is not a KeptError", errs[0])
	}
}

// errorLog records the error attribute of every record.
type errorLog struct{ msgs []string }

func (l *errorLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *errorLog) Handle(_ context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "error" {
			l.msgs = append(l.msgs, r.Message+": "+a.Value.String())
		}
		return true
	})
	return nil
}
func (l *errorLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *errorLog) WithGroup(string) slog.Handler      { return l }

// TestSourceKeepsEnrolledPodWhoseRuntimeClassIsDeleted: the API server
// lets a RuntimeClass be deleted while pods of it run; their sandboxes keep
// the handler they started with, which was not a skipped one if the pod was
// enrolled. Such a pod keeps its last good version, enrolled, with the
// error saying so; before, it was unenrolled (SKIP_RUNTIME_CLASSES set),
// and its traffic left the mesh. A pod of the class first seen without it
// is still left out.
func TestSourceKeepsEnrolledPodWhoseRuntimeClassIsDeleted(t *testing.T) {
	ns := []corev1.Namespace{ambientNamespace("shop")}
	web := pod("shop", "web", "node-a", "10.0.0.5")
	web.Spec.RuntimeClassName = new("fast")
	late := pod("shop", "late", "node-a", "10.0.0.6")
	late.Spec.RuntimeClassName = new("fast")
	classes := []nodev1.RuntimeClass{{ObjectMeta: metav1.ObjectMeta{Name: "fast"}, Handler: "runc"}}
	steps := []Objects{
		{Namespaces: ns, Pods: []corev1.Pod{web}, RuntimeClasses: classes},
		{Namespaces: ns, Pods: []corev1.Pod{late, web}},
	}
	var snaps []source.Snapshot
	var logs errorLog
	src := NewSource(objectList(steps), selection.Config{SkipRuntimeClasses: []string{"kata"}}, slog.New(&logs))
	if err := src.Run(context.Background(), func(s source.Snapshot) { snaps = append(snaps, s) }); err != nil {
		t.Fatal(err)
	}
	find := func(s source.Snapshot, name string) *workload.Workload {
		for _, w := range s.Workloads {
			if w.Name == name {
				return w
			}
		}
		return nil
	}
	if w := find(snaps[0], "web"); w == nil || !w.Enrolled {
		t.Fatalf("first snapshot: web = %+v, want enrolled", w)
	}
	if w := find(snaps[1], "web"); w == nil || !w.Enrolled {
		t.Errorf("class deleted: web = %+v, want its last good version, enrolled", w)
	}
	if w := find(snaps[1], "late"); w == nil || w.Enrolled {
		t.Errorf("class deleted: late = %+v, want present, not enrolled", w)
	}
	if n := len(snaps[1].Workloads); n != 2 {
		t.Errorf("class deleted: %d workloads, want 2", n)
	}
	if out := strings.Join(logs.msgs, "\n"); !strings.Contains(out, `pod shop/web: unknown runtime class "fast"`) || !strings.Contains(out, "last good version is kept") {
		t.Errorf("log %q does not name the pod and class, or say the pod is kept", out)
	}
}
